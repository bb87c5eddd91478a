"""OpenAI-compatible HTTP server (`lamina serve`): protocol models, serving logic, routes, metrics."""
