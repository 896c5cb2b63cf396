"""Plans for people: words for shardings, the tables the terminal and the HTML page draw, explain and diff.

Every report is made from the `Plan` alone (`summary.py` -> `tables.py` -> `render.py` / `html.py`), so
`autopar plan`, `show`, `--json` and `--html` say the same; `explain` also prices alternatives on the
re-traced model. Only the CLI commands (`commands.py`, through `console.py`) print.
"""
