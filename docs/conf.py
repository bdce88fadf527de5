"""Sphinx configuration of the lowrank_jax site: ``make docs`` (warnings are errors).

One thing is generated here, before Sphinx reads a page, and not committed:

* ``api/generated/<subpackage>.rst``: one page per subpackage of ``lowrank_jax``, in two tiers:
  an ``autosummary`` table of every name of the subpackage's ``__all__`` (its user tier), by kind,
  then each name documented in full; then "Building blocks", one subsection per public submodule
  with the names of its ``__all__`` that the subpackage does not export, documented the same way
  under their submodule path (no page per name: 650 stub pages made every page's navigation tree,
  and so the build, several times slower).

The notebooks are the executed copies committed in ``notebooks/*.ipynb`` (``colabs/*.ipynb`` run in
smoke mode by ``python -m tools.render_notebooks``), rendered with their stored outputs
and not executed here; a copy that is not current (other cells than its colab, a cell not run) is a
warning, so an error with ``-W``.

Nothing is fetched from the network at build time (no intersphinx inventories).
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import pkgutil
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
nb_execution_mode = "off"  # stored outputs (tools/render_notebooks.py), checked below
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


def _submodules(package) -> list:
    """The public submodules of a subpackage (no ``_private`` ones), in name order."""
    names = sorted(
        m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")
    )
    return [importlib.import_module(f"{package.__name__}.{name}") for name in names]


def _building_blocks(package, submodule) -> list[str]:
    """The names of ``submodule.__all__`` documented under it: not in the package's ``__all__``
    (the user tier, documented at the top of the page) and defined there (not re-exported)."""
    tier = {id(getattr(package, public)) for public in package.__all__}
    out = []
    for public in getattr(submodule, "__all__", ()):
        obj = getattr(submodule, public)
        if public in package.__all__ or (id(obj) in tier and _kind(obj) != "data"):
            continue
        home = getattr(obj, "__module__", None) if _kind(obj) in ("class", "function") else None
        if home and home.startswith("lowrank_jax.") and home != submodule.__name__:
            continue  # re-exported from another submodule: documented there
        out.append(public)
    return out


def _entries(module, names: list[str], heading_char: str | None) -> list[str]:
    """Autosummary tables and entries of ``names`` (attributes of ``module``), by kind.

    With ``heading_char``: a heading, a table and the entries for each kind; without: one table
    of all the names, then the entries, by kind.
    """
    groups: dict[str, list[str]] = {"module": [], "class": [], "function": [], "data": []}
    for public in names:
        groups[_kind(getattr(module, public))].append(public)
    headings = {
        "class": "Classes",
        "function": "Functions",
        "data": "Constants",
        "module": "Submodules",
    }
    kinds = [kind for kind in ("class", "function", "data", "module") if groups[kind]]
    table = [".. autosummary::", "   :nosignatures:", ""]
    lines: list[str] = []
    if not heading_char:
        ordered = [n for kind in kinds for n in sorted(groups[kind], key=str.lower)]
        lines += [f".. currentmodule:: {module.__name__}", ""]
        lines += table + [f"   {public}" for public in ordered] + [""]
    for kind in kinds:
        ordered = sorted(groups[kind], key=str.lower)
        if heading_char:
            heading = headings[kind]
            lines += [heading, heading_char * len(heading), ""]
            lines += [f".. currentmodule:: {module.__name__}", ""]
            lines += table + [f"   {public}" for public in ordered] + [""]
        directive, *options = _AUTODOC[kind]
        for public in ordered:
            target = public
            if kind == "module":  # a subsection each: the submodule in full, in source order
                target = getattr(module, public).__name__
                lines += [target, "~" * len(target), ""]
            lines += [f".. {directive}:: {target}", *options, ""]
    return lines


def _sections(package) -> list[tuple]:
    """``(submodule, building blocks, indexed)`` for each public submodule documented under
    "Building blocks" (not one the package exports as a module object). ``indexed`` is False for
    a submodule named like a name of the package (``adapters.adapt``, the function, beside the
    module ``lowrank_jax.adapters.adapt``): its docstring is shown without a module target."""
    tier = {id(getattr(package, public)) for public in package.__all__}
    return [
        (sub, _building_blocks(package, sub), sub.__name__.rsplit(".", 1)[1] not in package.__all__)
        for sub in _submodules(package)
        if id(sub) not in tier
    ]


def write_api_pages() -> None:
    """One page per subpackage, in two tiers.

    First the user tier, the subpackage's ``__all__``: its docstring, then for each kind of name an
    autosummary table and each name documented in full. Then "Building blocks": one subsection per
    public submodule (``lowrank_jax.<subpackage>.<submodule>``), its docstring and the names of its
    ``__all__`` that the subpackage does not export (an autosummary table, then each in full),
    documented under their submodule path, the one they are imported from.
    """
    out = DOCS / "api" / "generated"
    out.mkdir(parents=True, exist_ok=True)
    for name in SUBPACKAGES:
        module = importlib.import_module(f"lowrank_jax.{name}")
        title = f"lowrank_jax.{name}"
        lines = [title, "=" * len(title), "", f".. automodule:: lowrank_jax.{name}", ""]
        lines += _entries(module, list(module.__all__), "-")
        sections = _sections(module)
        example = next(((sub, names) for sub, names, _ in sections if names), None)
        if sections:
            heading = "Building blocks"
            lines += [heading, "-" * len(heading), ""]
            intro = (
                f"Each submodule of ``lowrank_jax.{name}``, with the names of its ``__all__`` that "
                f"``lowrank_jax.{name}`` does not export; import them from the submodule"
            )
            if example:
                intro += f": ``from {example[0].__name__} import {example[1][0]}``"
            lines += [intro + ".", ""]
            for sub, names, indexed in sections:
                lines += [sub.__name__, "~" * len(sub.__name__), ""]
                lines += [f".. automodule:: {sub.__name__}"]
                lines += ([] if indexed else ["   :no-index:"]) + [""]
                if names:
                    lines += _entries(sub, names, None)
                else:
                    lines += [f"Nothing beyond what ``lowrank_jax.{name}`` exports (above).", ""]
        _write_if_changed(out / f"{name}.rst", "\n".join(lines))


def _check_notebooks(app) -> None:
    """A warning for each stored notebook that is not its colab executed (or is missing)."""
    from tools import render_notebooks

    for colab in sorted((REPO / "colabs").glob("*.ipynb")):
        reason = render_notebooks.stale(colab, DOCS / "notebooks" / colab.name)
        if reason:
            _LOGGER.warning(f"{reason}: run python -m tools.render_notebooks {colab.stem}")


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
        for sub in SUBPACKAGES:  # then the building blocks, under their submodule
            module = importlib.import_module(f"lowrank_jax.{sub}")
            for submodule, names, indexed in _sections(module):
                if indexed:  # else references to it go to the subpackage's page
                    _PUBLIC.setdefault(id(submodule), submodule.__name__)
                for public in names:
                    _PUBLIC.setdefault(
                        id(getattr(submodule, public)), f"{submodule.__name__}.{public}"
                    )
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
        kind = "mod" if inspect.ismodule(obj) else "obj"
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
