"""`lamina eval demo` on a stand-in for the shipped demo model: a tiny random Qwen4-Exp with MTP
weights, the default model's tokenizer and chat template, and an `eval.jsonl` whose answers are
the model's own greedy outputs (so the accuracy is known exactly), plus one wrong answer."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from lamina import LLM, SamplingParams
from lamina.entrypoints import eval_cmd
from lamina.entrypoints.cli import main
from lamina.entrypoints.eval_cmd import EvalItem, evaluate, format_report, load_eval_items
from tests import tiny_checkpoints as tc

ENGINE = dict(device="cpu", dtype="float32", show_progress=False)
CPU = ["--device", "cpu", "--dtype", "float32"]
MTP2 = '{"method": "mtp", "num_speculative_tokens": 2}'
PROMPTS = [  # (id, task, prompt, max_tokens)
    (1, "add", "What is 352 + 419?", 6),
    (2, "add", "What is 7 + 5?", 8),
    (3, "word", "Name a colour.", None),  # the default max_tokens
]


def _write(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The stand-in model directory and the reference completions (LLM.chat, greedy)."""
    path = tc.add_mtp_weights(tc.make_qwen4_exp(tmp_path_factory.mktemp("demo") / "demo_model"), shared_head=True)
    with LLM(str(path), **ENGINE) as llm:
        texts = [
            llm.chat([{"role": "user", "content": prompt}],
                     SamplingParams(temperature=0.0, max_tokens=mt or eval_cmd.DEFAULT_MAX_TOKENS),
                     use_tqdm=False)[0].outputs[0].text
            for _, _, prompt, mt in PROMPTS
        ]
    answers = [texts[0].strip(), "not what the model says", texts[2].strip()]  # item 2 is wrong
    assert answers[0] and answers[2] and answers[1] != texts[1].strip()
    items = []
    for (id_, task, prompt, mt), answer in zip(PROMPTS, answers):
        item = {"id": id_, "task": task, "prompt": prompt, "answer": answer}
        if mt is not None:
            item["max_tokens"] = mt
        items.append(item)
    _write(path / "eval.jsonl", items)
    return path, texts


def run_json(capsys, *argv) -> dict:
    assert main(["eval", "demo", *CPU, "--json", *argv]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on stdout
    return json.loads(out)


# ---- the eval file ----------------------------------------------------------------------------
def test_load_eval_items(tmp_path):
    path = tmp_path / "e.jsonl"
    _write(path, [{"id": 17, "task": "add", "prompt": "What is 352 + 419?", "answer": "771", "max_tokens": 24},
                  "", {"id": "b", "task": "t", "prompt": "p", "answer": ""}, "{not json"])
    items = load_eval_items(path, limit=2)  # the malformed line after the first two items is never read
    assert items == [EvalItem(17, "add", "What is 352 + 419?", "771", 24, line=1),
                     EvalItem("b", "t", "p", "", None, line=3)]
    assert load_eval_items(path, limit=1) == items[:1]


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ({"id": 2, "task": "t", "prompt": "p"}, "missing key(s) 'answer'"),
    ({"id": 2, "task": "t", "prompt": "p", "answer": 771}, "'answer' must be a string"),
    ({"id": 2, "task": "t", "prompt": "", "answer": "a"}, "'prompt' must be a non-empty string"),
    ({"id": 2.5, "task": "t", "prompt": "p", "answer": "a"}, "'id' must be an integer or a string"),
    ({"id": 2, "task": "t", "prompt": "p", "answer": "a", "max_tokens": 0}, "'max_tokens' must be a positive integer"),
    ({"id": 1, "task": "t", "prompt": "p", "answer": "a"}, "id 1 repeats the id of line 1"),
])
def test_load_eval_items_names_the_bad_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    _write(path, [{"id": 1, "task": "t", "prompt": "p", "answer": "a"}, line])
    with pytest.raises(ValueError) as e:
        load_eval_items(path)
    assert f"{path}:2: " in str(e.value) and message in str(e.value)


def test_load_eval_items_empty_or_missing(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="no items"):
        load_eval_items(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="no eval set at"):
        load_eval_items(tmp_path / "absent.jsonl")


# ---- evaluate() -------------------------------------------------------------------------------
def test_evaluate_exact_match(demo):
    path, texts = demo
    items = load_eval_items(path / "eval.jsonl")
    with LLM(str(path), **ENGINE) as llm:
        record = evaluate(llm, items)
    assert (record["correct"], record["num_items"], record["errors"]) == (2, 3, 0)
    assert record["accuracy"] == pytest.approx(2 / 3)
    assert record["per_task"] == {
        "add": {"num_items": 2, "correct": 1, "errors": 0, "accuracy": 0.5},
        "word": {"num_items": 1, "correct": 1, "errors": 0, "accuracy": 1.0},
    }
    assert [r["output"] for r in record["results"]] == texts
    assert [r["correct"] for r in record["results"]] == [True, False, True]
    assert [r["num_output_tokens"] for r in record["results"]][:2] == [6, 8]
    assert record["output_tokens"] == sum(r["num_output_tokens"] for r in record["results"])
    assert record["output_tok_per_s"] == pytest.approx(record["output_tokens"] / record["elapsed_s"])
    assert record["acceptance_rate"] is None and record["mean_acceptance_length"] is None
    assert record["speculative_config"] is None and record["spec_decode"] is None
    assert record["layout"] == {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "sp": False}


def test_evaluate_counts_refused_requests_and_runs_the_rest(demo):
    """A prompt longer than max_model_len is refused by the engine: one error, the others scored."""
    path, _ = demo
    items = load_eval_items(path / "eval.jsonl") + [EvalItem(9, "add", "word " * 200, "x")]
    with LLM(str(path), max_model_len=96, **ENGINE) as llm:
        record = evaluate(llm, items)
    assert (record["correct"], record["num_items"], record["errors"]) == (2, 4, 1)
    assert record["per_task"]["add"] == {"num_items": 3, "correct": 1, "errors": 1, "accuracy": pytest.approx(1 / 3)}
    bad = record["results"][-1]
    assert bad["output"] is None and not bad["correct"] and "max_model_len" in bad["error"]
    assert "first error (item 9): ValueError: the prompt has" in format_report(record)


def test_evaluate_reports_acceptance_of_planted_drafts(demo):
    """Drafts planted from the plain greedy continuation are all accepted: rate 1, length > 1."""
    path, _ = demo
    items = load_eval_items(path / "eval.jsonl")[:2]
    with LLM(str(path), **ENGINE) as llm:
        plain = evaluate(llm, items)
    with LLM(str(path), **ENGINE, speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        reference = [r.outputs[0].token_ids for r in llm.chat(
            [[{"role": "user", "content": it.prompt}] for it in items],
            [SamplingParams(temperature=0.0, max_tokens=it.max_tokens) for it in items], use_tqdm=False)]
        first = len(items)  # the chat above used request ids 0 .. len(items) - 1; evaluate's come next

        def plant(request, proposed):
            i, n = int(request.request_id) - first, len(request.output_token_ids)
            return reference[i][n:n + len(proposed)]

        llm.engine.draft_override = plant
        record = evaluate(llm, items)
    assert [r["output"] for r in record["results"]] == [r["output"] for r in plain["results"]]
    assert record["acceptance_rate"] == 1.0 and record["mean_acceptance_length"] > 1.5
    assert record["spec_decode"]["num_accepted_tokens"] == record["spec_decode"]["num_draft_tokens"] > 0
    report = format_report(record)
    assert "speculative: mtp k=2 (policy fixed)" in report and "acceptance rate 1.000" in report


# ---- the command ------------------------------------------------------------------------------
def test_cli_json_record(demo, capsys, tmp_path):
    path, texts = demo
    out_file = tmp_path / "eval.json"
    record = run_json(capsys, "--model", str(path), "--output-json", str(out_file))
    for key in ("accuracy", "errors", "num_items", "correct", "acceptance_rate", "mean_acceptance_length",
                "output_tok_per_s", "per_task", "model", "elapsed_s", "layout", "speculative_config"):
        assert key in record, key
    assert record["accuracy"] == pytest.approx(2 / 3) and record["correct"] == 2 and record["num_items"] == 3
    assert record["errors"] == 0 and record["acceptance_rate"] is None and record["mean_acceptance_length"] is None
    assert record["model"] == str(path) and record["eval_file"] == str(path / "eval.jsonl")
    assert record["max_num_seqs"] == 64 and record["suite"] == "demo" and "results" not in record
    saved = json.loads(out_file.read_text())
    assert [(r["id"], r["task"], r["output"], r["correct"]) for r in saved["results"]] == [
        (1, "add", texts[0], True), (2, "add", texts[1], False), (3, "word", texts[2], True)]
    assert saved["results"][1]["answer"] == "not what the model says" and saved["accuracy"] == record["accuracy"]


def test_cli_limit_concurrency_and_default_model(demo, capsys, monkeypatch):
    path, _ = demo
    monkeypatch.setattr(eval_cmd, "default_model_path", lambda: str(path))  # the shipped demo model, later
    record = run_json(capsys, "--limit", "2", "--concurrency", "2")
    assert record["model"] == str(path) and record["num_items"] == 2 and record["correct"] == 1
    assert record["max_num_seqs"] == 2 and list(record["per_task"]) == ["add"]


def test_cli_speculative_matches_plain(demo, capsys, tmp_path):
    path, _ = demo
    plain_file, spec_file = tmp_path / "plain.json", tmp_path / "spec.json"
    plain = run_json(capsys, "--model", str(path), "--output-json", str(plain_file))
    spec = run_json(capsys, "--model", str(path), "--speculative-config", MTP2, "--output-json", str(spec_file))
    assert isinstance(spec["acceptance_rate"], float) and 0.0 <= spec["acceptance_rate"] <= 1.0
    assert isinstance(spec["mean_acceptance_length"], float) and 1.0 <= spec["mean_acceptance_length"] <= 3.0
    assert spec["speculative_config"]["method"] == "mtp" and spec["speculative_config"]["num_speculative_tokens"] == 2
    assert spec["spec_decode"]["num_draft_tokens"] > 0
    assert (spec["correct"], spec["accuracy"]) == (plain["correct"], plain["accuracy"])
    outputs = [[r["output"] for r in json.loads(f.read_text())["results"]] for f in (plain_file, spec_file)]
    assert outputs[0] == outputs[1]


def test_cli_table_and_progress_bar_only_on_a_terminal(demo, capsys, monkeypatch):
    path, _ = demo
    assert main(["eval", "demo", *CPU, "--model", str(path)]) == 0
    captured = capsys.readouterr()
    assert "| all | 3 | 2 | 0 | 66.7% |" in captured.out and "| add | 2 | 1 | 0 | 50.0% |" in captured.out
    assert "output tok/s" in captured.out and "Processed prompts" not in captured.err  # stderr is not a TTY
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main(["eval", "demo", *CPU, "--model", str(path)]) == 0
    assert "Processed prompts" in capsys.readouterr().err
    assert main(["eval", "demo", *CPU, "--model", str(path), "--json"]) == 0
    assert "Processed prompts" not in capsys.readouterr().err


def test_cli_errors(demo, capsys, tmp_path):
    path, _ = demo
    bare = shutil.copytree(path, tmp_path / "bare", ignore=shutil.ignore_patterns("eval.jsonl"))
    assert main(["eval", "demo", *CPU, "--model", str(bare)]) == 2
    assert f"no eval set at {bare / 'eval.jsonl'}" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    _write(bad, [{"id": 1, "task": "t", "prompt": "p", "answer": "a"}, {"id": 2, "task": "t", "prompt": "p"}])
    assert main(["eval", "demo", *CPU, "--model", str(path), "--eval-file", str(bad)]) == 2
    assert f"{bad}:2: missing key(s) 'answer'" in capsys.readouterr().err
    assert main(["eval", "demo", *CPU, "--model", str(path), "--concurrency", "4", "--max-num-seqs", "8"]) == 2
    assert "disagree" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "demo", "--limit", "0"])
