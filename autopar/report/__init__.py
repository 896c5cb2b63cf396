"""Plans for people: words for shardings, the rich report, the HTML page, explain and diff.

Everything here reads a `Plan` (plus, when given, the traced graph and profile)
and returns plain data or text; only the CLI commands (`commands.py`, through `console.py`) print.
"""
