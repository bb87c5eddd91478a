"""Which checkpoint tensors a model (stage) needs, and the loader of each."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

Loader = Callable[[str, torch.Tensor], None]


class WeightMap:
    def __init__(self) -> None:
        self.loaders: dict[str, Loader] = {}
        self.required: list[str] = []
        self.ignored: set[str] = set()
        # names whose loader takes a block FP8 tensor as stored (lamina.quantization.Fp8Weight)
        self.keeps_fp8: set[str] = set()
        # group name -> alternatives; each alternative is a list of names that must all be present
        self.one_of: dict[str, list[list[str]]] = {}

    def add(self, name: str, loader: Loader, *, required: bool = True, keeps_fp8: bool = False) -> None:
        """`keeps_fp8`: the loader keeps a block FP8 tensor as stored (values and scales) instead of
        receiving it dequantized."""
        self.loaders[name] = loader
        if required:
            self.required.append(name)
        if keeps_fp8:
            self.keeps_fp8.add(name)

    def ignore(self, name: str) -> None:
        self.ignored.add(name)

    def require_one_of(self, group: str, alternatives: list[list[str]]) -> None:
        self.one_of[group] = alternatives

    def missing(self, available: Iterable[str]) -> list[str]:
        """Descriptions of what the checkpoint lacks, given the names it holds."""
        have = set(available)
        missing = [n for n in self.required if n not in have]
        for group, alternatives in self.one_of.items():
            if not any(all(n in have for n in alt) for alt in alternatives):
                options = " or ".join(
                    f"[{alt[0]} ... ({len(alt)} tensors)]" if len(alt) > 2 else "[" + ", ".join(alt) + "]"
                    for alt in alternatives
                )
                present = [n for alt in alternatives for n in alt if n in have]
                detail = f"; found only {len(present)} of them" if present else ""
                missing.append(f"{group}: one complete layout of {options}{detail}")
        return missing
