"""Dashboards that render offline: the browser assets GX Data Docs and ``dvc plots show`` load from CDNs, served
from copies vendored in ``foresight/vendor/`` (its README lists each npm package, version and licence).

* **Data Docs** (great_expectations 1.24.1): the page templates (``render/view/templates/js_script_imports.j2``,
  ``index_page.j2``, ``page.j2``) hard-code CDN ``<script>`` / ``<link>`` URLs, and no site config replaces them:
  ``DefaultJinjaView`` (``render/view/view.py``) puts GX's own template loader *before* a plugins folder's
  ``custom_data_docs/views`` in its ``ChoiceLoader``, so a custom template of the same name is never read. Offline
  the pages are unstyled and the index, a bootstrap-table filled by jQuery from inline data, is an empty list.
  :func:`localize_data_docs` copies the vendored assets into the built site (``static/vendor/``) and points each
  page's CDN tags at them.
* **dvc plots show** (dvc_render 1.0.2, ``html.py``): the page template's ``{scripts}`` placeholder receives the
  vega renderer's CDN ``<script>`` tags. :func:`dvc_plots_template` is dvc_render's own page with vega, vega-lite
  and vega-embed inlined there instead, so the page works wherever ``dvc plots show -o DIR`` writes it;
  ``.dvc/config`` (``plots.html_template``) names the generated copy, :data:`DVC_PLOTS_TEMPLATE`
  (``foresight dvc-plots-template > foresight/vendor/dvc_plots.html``).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

VENDOR_DIR = Path(__file__).resolve().parent / "vendor"
"""The vendored browser assets, one folder per npm package with its licence."""

DVC_PLOTS_TEMPLATE = VENDOR_DIR / "dvc_plots.html"
"""The generated ``dvc plots show`` page template (:func:`dvc_plots_template`), named by ``.dvc/config``."""

CDN_ASSETS = {
    "https://cdn.jsdelivr.net/npm/vega@5": "vega/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5": "vega/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6": "vega/vega-embed.min.js",
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": "popper.js/popper.min.js",
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": "bootstrap/js/bootstrap.min.js",
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": "bootstrap/css/bootstrap.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": "bootstrap-table/bootstrap-table.min.js",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": "bootstrap-table/bootstrap-table.min.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/bootstrap-table-filter-control.min.js":
        "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.js",
    # GX's templates ask for 1.19.0's stylesheet (minified on the index, not on the other pages); 1.19.1's is the
    # same 4 rules
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.min.css":
        "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/bootstrap-table-filter-control.css":
        "bootstrap-table/extensions/filter-control/bootstrap-table-filter-control.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/bootstrap-datepicker.min.js":
        "bootstrap-datepicker/js/bootstrap-datepicker.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/bootstrap-datepicker.min.css":
        "bootstrap-datepicker/css/bootstrap-datepicker.min.css",
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/bootstrap-prefers-dark.css":
        "bootstrap-dark/bootstrap-prefers-dark.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": "fontawesome/css/all.min.css",
}
"""Each CDN URL of GX's Data Docs templates -> its vendored copy under :data:`VENDOR_DIR`."""

SITE_VENDOR = Path("static") / "vendor"
"""Where :func:`localize_data_docs` puts the assets inside a Data Docs site (beside GX's own ``static/``)."""

GX_WEB_ASSETS = "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/"
"""Where GX's ``top_navbar.j2`` loads its logo from (with the time and the context id as a query string); the site
holds the same image under ``static/images/``, which GX copies there itself."""

_TAG = re.compile(r"<(?:script|link|img)\b[^>]*>", re.IGNORECASE)
_URL = re.compile(r"""\b(?:src|href)=(["'])(?P<url>[^"']*)\1""", re.IGNORECASE)
# A subresource-integrity check needs a CORS fetch, which a page opened from file:// cannot make: the browser
# would refuse the local copy, so the attributes go with the CDN URL.
_CORS_ATTRS = re.compile(r"""\s+(?:integrity|crossorigin)(?:=(["'])[^"']*\1)?""", re.IGNORECASE)

_DVC_SCRIPTS = ("vega/vega.min.js", "vega/vega-lite.min.js", "vega/vega-embed.min.js")
"""dvc_render's vega renderer loads these three (``VegaRenderer.SCRIPTS``), in this order."""


def localize_data_docs(site_dir: Path) -> None:
    """Copy the vendored assets into the Data Docs site ``site_dir`` and point every page's CDN ``<script>`` /
    ``<link>`` at them, and its logo at the site's own copy, by relative URLs (the site opens from disk, wherever it
    is moved). A CDN URL missing from :data:`CDN_ASSETS` (a new GX release) is left
    as it is: ``tests/test_offline_docs.py`` fails on it."""
    site_dir = Path(site_dir)
    target = site_dir / SITE_VENDOR
    for asset in sorted(set(CDN_ASSETS.values())):
        (target / asset).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(VENDOR_DIR / asset, target / asset)
    # Font Awesome's stylesheet loads its fonts from ../webfonts/, beside its css/ folder
    shutil.copytree(VENDOR_DIR / "fontawesome" / "webfonts", target / "fontawesome" / "webfonts", dirs_exist_ok=True)

    images = site_dir / "static" / "images"
    for page in sorted(site_dir.rglob("*.html")):
        prefix = Path(os.path.relpath(target, page.parent)).as_posix()

        def local(tag: re.Match) -> str:
            found = _URL.search(tag.group(0))
            url = found.group("url") if found else ""
            image = url.removeprefix(GX_WEB_ASSETS).split("?")[0]
            if url in CDN_ASSETS:
                path = f"{prefix}/{CDN_ASSETS[url]}"
            elif url.startswith(GX_WEB_ASSETS) and (images / image).is_file():
                path = Path(os.path.relpath(images / image, page.parent)).as_posix()
            else:
                return tag.group(0)
            return _CORS_ATTRS.sub("", tag.group(0).replace(url, path))

        html = page.read_text(encoding="utf-8")
        localized = _TAG.sub(local, html)
        if localized != html:
            page.write_text(localized, encoding="utf-8")


def dvc_plots_template() -> str:
    """dvc_render's ``PAGE_HTML`` with the vendored vega, vega-lite and vega-embed inlined where its ``{scripts}``
    placeholder was: DVC then adds no CDN ``<script>`` (it fills only the placeholders a template has)."""
    from dvc_render.html import HTML, PAGE_HTML

    scripts = "\n".join([
        "<!-- Generated by `foresight dvc-plots-template > foresight/vendor/dvc_plots.html` (foresight/offline.py): "
        "do not edit. -->",
        *(f"<!-- foresight/vendor/{name}, licence: foresight/vendor/{Path(name).parent}/LICENSE -->\n"
          f"<script>{(VENDOR_DIR / name).read_text(encoding='utf-8')}</script>" for name in _DVC_SCRIPTS),
    ])
    return PAGE_HTML.replace("{" + HTML.SCRIPTS_PLACEHOLDER + "}", scripts) + "\n"
