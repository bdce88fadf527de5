"""Sphinx configuration of the lowrank_jax site: ``make docs`` (warnings are errors).

One thing is generated here, before Sphinx reads a page, and not committed:

* ``api/generated/<subpackage>.rst``: one page per subpackage of ``lowrank_jax``: an
  ``autosummary`` table of every name of the subpackage's ``__all__``, by kind, then each name
  documented in full on the same page (no page per name: 650 stub pages made every page's
  navigation tree, and so the build, several times slower).

The notebooks are the executed copies committed in ``notebooks/*.ipynb`` (``colabs/*.ipynb`` run in
smoke mode by ``python -m experiments.tools.render_notebooks``), rendered with their stored outputs
and not executed here; a copy that is not current (other cells than its colab, a cell not run) is a
warning, so an error with ``-W``.

Nothing is fetched from the network at build time (no intersphinx inventories).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

from sphinx.util import logging as sphinx_logging

DOCS = pathlib.Path(__file__).resolve().parent
REPO = DOCS.parent
sys.path.insert(0, str(REPO))

import lowrank_jax  # noqa: E402

_LOGGER = sphinx_logging.getLogger(__name__)

project = "lowrank_jax"
author = "the lowrank_jax authors"
copyright = "2026, the lowrank_jax authors"
release = version = lowrank_jax.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

# The subpackages, in the order of the API reference.
SUBPACKAGES = (
    "adapters",
    "continual",
    "optim",
    "spectral",
    "fp8",
    "merging",
    "kge",
    "generative",
    "changepoint",
    "selection",
    "tuning",
    "prompts",
    "analysis",
    "models",
    "data",
)

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
# api/generated/_autosummary: the per-name stub pages of an older build, no longer written.
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "jupyter_execute"]
exclude_patterns += ["api/generated/_autosummary"]
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# --- MyST / myst-nb ---------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # stored outputs (experiments/tools/render_notebooks.py), checked below
nb_merge_streams = True

# --- autodoc / autosummary / napoleon ------------------------------------------------------------
autosummary_generate = False  # the tables link to the entries on the same page
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # flax's Module.setup etc. are not ours to document
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True
add_module_names = False

# Broken cross-references are errors (with -W). References to objects outside lowrank_jax
# (jax, flax, numpy, ...) cannot resolve offline (no intersphinx inventories), so they are ignored.
nitpicky = True
nitpick_ignore = [
    ("py:class", "Prompts"),  # a private type alias of lowrank_jax.prompts.methods
]
nitpick_ignore_regex = [
    (
        r"py:.*",
        r"(jax|jnp|jaxlib|flax|nn|nnx|optax|np|numpy|chex|orbax|ml_collections|typing|"
        r"collections|abc|pathlib|os|io|dataclasses|enum|functools|types|builtins|scipy|sklearn|"
        r"matplotlib|quax|qwix|tinygp|tokenizers|safetensors|tensorflow_datasets|tfds|optuna|"
        r"torch|concurrent|threading|contextlib|jaxtyping|numbers|re|collections\.abc)(\..*)?",
    ),
    (
        r"py:.*",
        r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|Literal|Protocol|NamedTuple|"
        r"TypeVar|Generic|Optional|Union|ClassVar|Self|Array|ArrayLike|PyTree|PRNGKey|Key|DTypeLike|"
        r"Shape|int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|complex|"
        r"Ellipsis|NoneType|PathLike|MutableMapping|Hashable|Generator)",
    ),
]

# --- HTML -----------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "lowrank_jax"
html_theme_options = {
    "repository_url": "https://github.com/lowrank-jax/lowrank_jax",
    "repository_branch": "main",
    "path_to_docs": "docs",
    "use_repository_button": True,
    "use_source_button": True,
    "show_toc_level": 2,
    # The sidebar lists pages to depth 2 (guides, papers, the subpackages' API pages).
    "max_navbar_depth": 2,
    "navigation_with_keys": False,
}


# --- generated sources ------------------------------------------------------------------------
def _kind(obj) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if inspect.isroutine(obj) or (callable(obj) and not _is_alias(obj)):
        return "function"
    return "data"


def _is_alias(obj) -> bool:
    """A type alias such as ``AdapterSet = dict[str, Adapter]`` (documented as a constant)."""
    return type(obj).__module__ in ("types", "typing") and not inspect.isroutine(obj)


def _write_if_changed(path: pathlib.Path, text: str) -> None:
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# How each kind of public name is documented on its subpackage's page.
_AUTODOC = {
    "class": ["autoclass", "   :members:", "   :show-inheritance:"],
    "function": ["autofunction"],
    "data": ["autodata"],
    "module": ["automodule", "   :members:"],
}


def write_api_pages() -> None:
    """One page per subpackage: its docstring, then for each kind of name in its ``__all__`` an
    autosummary table and each name documented in full (submodules last, in their source order)."""
    out = DOCS / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    for name in SUBPACKAGES:
        module = importlib.import_module(f"lowrank_jax.{name}")
        groups: dict[str, list[str]] = {"module": [], "class": [], "function": [], "data": []}
        for public in module.__all__:
            groups[_kind(getattr(module, public))].append(public)
        title = f"lowrank_jax.{name}"
        lines = [title, "=" * len(title), "", f".. automodule:: lowrank_jax.{name}", ""]
        headings = {
            "class": "Classes",
            "function": "Functions",
            "data": "Constants",
            "module": "Submodules",
        }
        for kind in ("class", "function", "data", "module"):
            if not groups[kind]:
                continue
            heading = headings[kind]
            lines += [heading, "-" * len(heading), "", f".. currentmodule:: lowrank_jax.{name}", ""]
            names = sorted(groups[kind], key=str.lower)
            lines += [".. autosummary::", "   :nosignatures:", ""]
            lines += [f"   {public}" for public in names] + [""]
            directive, *options = _AUTODOC[kind]
            for public in names:
                target = public
                if kind == "module":  # a subsection each: the submodule in full, in source order
                    target = getattr(module, public).__name__
                    lines += [target, "~" * len(target), ""]
                lines += [f".. {directive}:: {target}", *options, ""]
        _write_if_changed(out / f"{name}.rst", "\n".join(lines))


def _check_notebooks(app) -> None:
    """A warning for each stored notebook that is not its colab executed (or is missing)."""
    from experiments.tools import render_notebooks

    for colab in sorted((REPO / "colabs").glob("*.ipynb")):
        reason = render_notebooks.stale(colab, DOCS / "notebooks" / colab.name)
        if reason:
            _LOGGER.warning(
                f"{reason}: run python -m experiments.tools.render_notebooks {colab.stem}"
            )


write_api_pages()


# --- constants and type aliases: their comment in the source, not the docstring of their type ----
def _source_comment(fullname: str) -> list[str]:
    """The ``#`` comment block right above ``NAME = ...`` (or ``NAME: T = ...``) in the subpackage."""
    parts = fullname.split(".")
    if len(parts) < 3 or parts[0] != "lowrank_jax":
        return []
    name, folder = parts[-1], REPO / "lowrank_jax" / parts[1]
    pattern = re.compile(rf"^{re.escape(name)}\s*(:[^=]*)?=")
    for path in sorted(folder.glob("*.py")):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if pattern.match(line):
                block = []
                j = i - 1
                while j >= 0 and lines[j].startswith("#"):
                    block.insert(0, lines[j].lstrip("#").strip())
                    j -= 1
                return block
    return []


def _constant_docstring(app, what, name, obj, options, lines) -> None:
    if what not in ("data", "attribute") or not name.startswith("lowrank_jax."):
        return
    own = inspect.getdoc(type(obj)) or ""
    text = "\n".join(lines).strip()
    if text and text != own.strip() and not _is_alias(obj):
        return  # a docstring of its own (a ``#:`` comment)
    comment = _source_comment(name)
    lines[:] = [" ".join(comment)] if comment else [f"A constant of type ``{type(obj).__name__}``."]
    lines.append("")


# --- references to private module paths resolve to the public name --------------------------
_PUBLIC: dict[int, str] = {}


def _public_names() -> dict[int, str]:
    if not _PUBLIC:
        for sub in SUBPACKAGES:
            module = importlib.import_module(f"lowrank_jax.{sub}")
            _PUBLIC.setdefault(id(module), f"lowrank_jax.{sub}")
            for public in module.__all__:
                _PUBLIC.setdefault(id(getattr(module, public)), f"lowrank_jax.{sub}.{public}")
    return _PUBLIC


def _lookup(dotted: str):
    """The object a dotted name names (a module prefix imported, then attributes), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:  # noqa: BLE001 - any import failure: try a shorter prefix
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _resolve_private(app, env, node, contnode):
    """``lowrank_jax.fp8.policies.geometry_scaling_policy`` -> ``lowrank_jax.fp8.geometry_...``.

    Docstrings name objects where they are defined, or relative to their defining module; the
    site documents each under its subpackage's ``__all__``. Unresolvable names still warn.
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    contexts = [node.get("py:module") or ""]
    source, parent = node.source, node.parent  # "...:docstring of lowrank_jax.fp8.policies.name"
    while not source and parent is not None:
        source, parent = parent.source, parent.parent
    source = str(source or "")
    if "docstring of " in source:
        defined = source.split("docstring of ", 1)[1].split(":")[0]
        parts = defined.split(".")
        contexts += [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
    candidates = [target] + [f"{ctx}.{target}" for ctx in contexts if ctx]
    public = _public_names()
    domain = env.get_domain("py")
    for candidate in candidates:
        if not candidate.startswith("lowrank_jax"):
            continue
        obj = _lookup(candidate)
        if obj is None:
            continue
        name = public.get(id(obj))
        if name is None and inspect.ismodule(obj):
            name = public.get(id(_lookup(".".join(candidate.split(".")[:2]))))
        if name is None and candidate in domain.objects:
            name = candidate
        if name is None:
            name = getattr(obj, "__module__", "") + "." + getattr(obj, "__qualname__", "")
            if name not in domain.objects:
                continue
        kind = "mod" if inspect.ismodule(obj) and name.count(".") == 1 else "obj"
        ref = domain.resolve_xref(env, node["refdoc"], app.builder, kind, name, node, contnode)
        if ref is not None:
            return ref
    # An autosummary table has no module context: a name that ends exactly one public name.
    ends = sorted({name for name in public.values() if name.endswith("." + target)})
    if len(ends) == 1 and "." not in target:
        return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", ends[0], node, contnode)
    return None


def _skip_documented_fields(app, what, name, obj, skip, options):
    """A NamedTuple or dataclass field that the class docstring's ``Attributes:`` already documents.

    Napoleon turns that section into attribute entries; autodoc's ``:members:`` would document
    the same fields again (duplicate object descriptions).
    """
    if skip or what != "class":
        return None
    cls = _lookup(
        f"{app.env.temp_data.get('autodoc:module')}.{app.env.temp_data.get('autodoc:class')}"
    )
    fields = set(getattr(cls, "_fields", ())) | set(getattr(cls, "__dataclass_fields__", {}))
    if name in fields and "Attributes:" in (inspect.getdoc(cls) or ""):
        return True
    return None


def setup(app):
    app.connect("builder-inited", _check_notebooks)
    app.connect("autodoc-process-docstring", _constant_docstring)
    app.connect("missing-reference", _resolve_private)
    app.connect("autodoc-skip-member", _skip_documented_fields)
