"""mkdocs hooks that make the built site read offline, from file://, with nothing fetched at view time.

Math: the course notebooks write display math as ``$$ ... $$`` (nbconvert leaves it for a MathJax that the
site does not load), and Markdown pages as ``$$ ... $$`` / ``$ ... $`` (pymdownx.arithmatex wraps them in
``\\[ ... \\]`` / ``\\( ... \\)``). Both are converted at build time to MathML (latex2mathml, from PyPI), which
browsers draw natively: no script, no font, no network. A formula latex2mathml cannot read fails the build
with its page and text, rather than shipping raw LaTeX.

Search: Material's offline plugin inlines the index into ``search/search_index.js`` and runs the search
worker through the iframe-worker shim; the shim is vendored (``docs/assets/iframe-worker``, MIT, from npm)
and named in ``extra.polyfills``, so the plugin does not add its remote copy.
"""
from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_DISPLAY = re.compile(r"\$\$(.+?)\$\$", re.S)
_ARITHMATEX = re.compile(r'<(div|span) class="arithmatex">\s*\\([\[(])(.+?)\\[\])]\s*</\1>', re.S)
# nbconvert's MathJax loader (an empty src) and its configuration: nothing to load, nothing to configure
_MATHJAX = re.compile(r'<!-- Load mathjax -->\s*<script src="">\s*</script>\s*<!-- MathJax configuration -->\s*'
                      r'<script type="text/x-mathjax-config">.*?</script>', re.S)
_CODE = re.compile(r"(<(pre|code|script|style|textarea)\b.*?</\2>)", re.S | re.I)


def _mathml(tex: str, display: bool, where: str) -> str:
    try:
        out = convert(html.unescape(tex).strip(), display="block" if display else "inline")
    except Exception as e:  # a formula the converter cannot read: say which, fail the build
        raise ValueError(f"{where}: cannot render the formula {tex.strip()[:80]!r} as MathML ({e})") from e
    return out


def _convert(text: str, where: str) -> str:
    text = _ARITHMATEX.sub(lambda m: _mathml(m.group(3), m.group(2) == "[", where), text)
    return _DISPLAY.sub(lambda m: _mathml(m.group(1), True, where), text)


def on_post_page(output: str, page, config) -> str:
    """Every page's math as MathML; code, scripts and styles are left exactly as they are."""
    output = _MATHJAX.sub("", output)
    where = page.file.src_uri
    parts = _CODE.split(output)
    # split with two groups yields [text, whole, tag-name, text, whole, tag-name, ...]
    for i in range(0, len(parts), 3):
        parts[i] = _convert(parts[i], where)
    return "".join(p for i, p in enumerate(parts) if i % 3 != 2)
