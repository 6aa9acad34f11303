"""Sphinx configuration for the dask-surge documentation.

Build (offline, warnings are errors)::

    pip install -e ".[docs]"
    python -m sphinx -W --keep-going -b html docs docs/_build/html

The API reference is generated from the package's numpydoc docstrings; every module
path it documents is listed once, in ``api.rst``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import dask_surge

project = "dask-surge"
author = "dask-surge developers"
copyright = "dask-surge developers"
release = dask_surge.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.viewcode",
    "numpydoc",
    "myst_parser",
    "sphinxarg.ext",
]

# intersphinx fetches inventories over the network; the build must work offline, so it is
# only switched on when asked for (SURGE_DOCS_INTERSPHINX=1).
if os.environ.get("SURGE_DOCS_INTERSPHINX") == "1":
    extensions.append("sphinx.ext.intersphinx")
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "dask": ("https://docs.dask.org/en/stable", None),
        "distributed": ("https://distributed.dask.org/en/stable", None),
        "pandas": ("https://pandas.pydata.org/docs", None),
        "numpy": ("https://numpy.org/doc/stable", None),
    }

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# quotes and ellipses only: "--flag" in the generated CLI reference must stay two hyphens
smartquotes_action = "qe"
templates_path = ["_templates"]
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "requirements.txt"]

# -- MyST (markdown pages) --------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc / autosummary -------------------------------------------------------------
autosummary_generate = True          # stub pages under docs/_autosummary/ (build output)
autosummary_imported_members = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "none"           # numpydoc's Parameters sections carry the types
autodoc_mock_imports: list[str] = []  # everything documented imports without GPUs or RAPIDS

# -- numpydoc ----------------------------------------------------------------------------
# The docstrings are numpydoc with Examples sections. Members are listed by autodoc, not
# numpydoc (otherwise every class grows an autosummary table of stubs that do not exist),
# and numpydoc's style validation stays off: ruff and the doctests check the docstrings.
numpydoc_show_class_members = False
numpydoc_show_inherited_class_members = False
numpydoc_class_members_toctree = False
numpydoc_validation_checks: set[str] = set()
numpydoc_xref_param_type = False
numpydoc_use_plots = False

# -- HTML --------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"dask-surge {release}"
html_static_path: list[str] = []
html_show_sourcelink = False



# -- optional pages ----------------------------------------------------------------------
# index.md lists pages that other work adds (the A/B-studies summary, ab_studies.md). Until
# such a page exists, the toctree that names it is dropped when index.md is read, so the
# build (warnings as errors) passes before and after it lands.
HERE = Path(__file__).resolve().parent
OPTIONAL_PAGES = ["ab_studies"]


def _drop_missing_optional_pages(app, docname, source):
    if docname != "index":
        return
    for page in OPTIONAL_PAGES:
        if not any((HERE / f"{page}{suffix}").exists() for suffix in source_suffix):
            source[0] = re.sub(r"```\{toctree\}\n(?:(?!```).)*?^" + page + r"$\n```\n", "", source[0],
                               flags=re.S | re.M)


def _reread_index(app, env, added, changed, removed):
    return ["index"]  # an optional page may have appeared or gone


def setup(app):
    app.connect("source-read", _drop_missing_optional_pages)
    app.connect("env-get-outdated", _reread_index)
