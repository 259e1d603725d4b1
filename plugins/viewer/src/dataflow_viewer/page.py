"""The HTML around the panels, one template for the report and the served page: BokehJS
and its stylesheet inlined (``bokeh.resources.INLINE``), so a page needs no network."""

from __future__ import annotations

import html

from bokeh.resources import INLINE

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
h2 { font-size: 1.2em; border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.5em; }
.source { color: #666; margin-top: 0; }
.cards { display: flex; flex-wrap: wrap; gap: 0.8em; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 0.5em 0.8em; min-width: 11em; }
.card h3 { font-size: 0.85em; margin: 0 0 0.3em 0; color: #555; font-weight: 600; }
.card-row { display: flex; justify-content: space-between; gap: 1em; font-size: 0.9em; }
.card-row span { color: #777; }
.note { color: #8a5a00; }
.error { color: #b00020; font-weight: 600; }
form.controls { display: flex; flex-wrap: wrap; gap: 0.8em 1.2em; align-items: end;
                padding: 0.8em; background: #f6f6f6; border-radius: 6px; }
form.controls label { display: flex; flex-direction: column; font-size: 0.85em; gap: 0.2em; }
form.controls input[type=number], form.controls input[type=text] { width: 8em; }
"""

#: section id -> heading, in page order
SECTIONS = {
    "cards": "Summary",
    "timeline": "Timeline, memory and links",
    "deviations": "Tasks that deviate most",
    "stalls": "Stall attribution",
    "sweep": "Budget sweep",
}


def page(title: str, body: str, script: str = "") -> str:
    """A whole HTML document: ``body`` (already HTML) and ``script`` (already tags)."""
    return (
        "<!DOCTYPE html>\n<html lang='en'>\n<head>\n<meta charset='utf-8'>\n"
        f"<title>{html.escape(title)}</title>\n<link rel='icon' href='data:,'>\n"
        f"<style>{STYLE}</style>\n"
        f"{INLINE.render()}\n</head>\n<body>\n{body}\n{script}\n</body>\n</html>\n"
    )


def sections(contents: dict[str, str]) -> str:
    """One ``<section>`` per ``SECTIONS`` entry holding ``contents[id]`` (HTML)."""
    return "\n".join(
        f'<section id="{key}"><h2>{heading}</h2>\n'
        f'<div class="panel" id="panel-{key}">{contents.get(key, "")}</div></section>'
        for key, heading in SECTIONS.items()
    )
