"""The `topk` command line (typer + rich). Commands live in one module each; `app.py` registers them."""
