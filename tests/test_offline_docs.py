"""Dashboards that render offline (issue #34, defect 4): ``foresight/offline.py`` and the vendored assets.

The built Data Docs themselves are checked in ``tests/test_validation.py`` (``test_good_tables_pass_and_write_data_docs``
reuses its real GX run); here: GX's installed templates ask for nothing that is not vendored, and ``dvc plots show``
in a DVC repo with this checkout's ``.dvc/config`` writes a page that loads no script from the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from importlib.util import find_spec

from foresight.offline import CDN_ASSETS, DVC_PLOTS_TEMPLATE, VENDOR_DIR, dvc_plots_template

REPO = Path(__file__).resolve().parents[1]
# found without importing GX (seconds)
GX_TEMPLATES = Path(find_spec("great_expectations").origin).parent / "render" / "view" / "templates"
_EXTERNAL = re.compile(r"<script\b[^>]*\bsrc=\"(https?://[^\"]+)\"|<link\b[^>]*\bhref=\"(https?://[^\"]+)\"")


def test_every_cdn_asset_of_gx_templates_is_vendored_with_its_licence():
    """A GX release that adds or moves a CDN asset fails here, naming the URL to vendor."""
    urls = {a or b for t in GX_TEMPLATES.glob("*.j2") for a, b in _EXTERNAL.findall(t.read_text())}
    assert len(urls) >= 10  # the regex still finds GX's tags
    assert sorted(urls - set(CDN_ASSETS)) == []
    for asset in CDN_ASSETS.values():
        package = VENDOR_DIR / asset.split("/")[0]
        assert (VENDOR_DIR / asset).stat().st_size > 0, asset
        assert any(package.glob("LICENSE*")), f"no licence file in {package}"
    # Font Awesome's stylesheet names its fonts relative to itself: the woff2 files are there
    css = (VENDOR_DIR / "fontawesome" / "css" / "all.min.css").read_text()
    fonts = set(re.findall(r"url\(\.\./webfonts/([\w-]+\.woff2)\)", css))
    assert fonts and all((VENDOR_DIR / "fontawesome" / "webfonts" / f).is_file() for f in fonts)


def test_committed_dvc_plots_template_is_the_generated_one():
    assert DVC_PLOTS_TEMPLATE.read_text(encoding="utf-8") == dvc_plots_template(), \
        "run: foresight dvc-plots-template > foresight/vendor/dvc_plots.html"


def test_dvc_plots_show_loads_no_script_from_the_network(tmp_path):
    """``dvc plots show`` in a repo with this checkout's ``.dvc/config`` (its ``plots.html_template`` is relative to
    ``.dvc/``) writes the plot with vega inlined and no ``<script src>``; DVC's default page has three CDN ones."""
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True, env=env)
    shutil.copyfile(REPO / ".dvc" / "config", tmp_path / ".dvc" / "config")
    (tmp_path / "foresight").symlink_to(REPO / "foresight")
    (tmp_path / "curves").mkdir()
    (tmp_path / "curves" / "loss.csv").write_text("step,value\n1,0.75\n2,0.5\n3,0.375\n")

    out = subprocess.run(["dvc", "plots", "show", "curves/loss.csv", "-o", "page"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, check=True)
    html = (tmp_path / "page" / "index.html").read_text(encoding="utf-8")
    assert re.findall(r"<script\b[^>]*\bsrc=", html) == [], out.stdout
    assert _EXTERNAL.findall(html) == []
    for name in ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js"):  # inlined, whole
        assert (VENDOR_DIR / "vega" / name).read_text(encoding="utf-8") in html, name
    assert "vegaEmbed(" in html and "0.375" in html  # the plot itself, with the CSV's data
