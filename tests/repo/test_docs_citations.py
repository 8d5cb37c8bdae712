"""Every citation in the repository names something that exists: a section of a document (docs/design.md,
"Definitions", or a note beside it, docs/design/worker.md, "Out-of-memory retries": a heading of that title in that
file), a file (tests/repo/test_error_types.py, fastvideo_integration/uploads.py, with
a `:LINE` not past its end) and a module path in backquotes (`vae_kernel.definitions.precision.exact_fp32`,
`memory.MemoryPlanner.retry_plan`). Read from the text alone: nothing is imported or run.

The forms checked, as the repository writes them, in its .py, .md, .yaml and .sh files (not .venv, .git, out/ and
the other ignored folders; not this file, whose examples are planted mistakes):
- a section: `docs/NAME.md` or `docs/FOLDER/NAME.md` (or `NAME.md` or `FOLDER/NAME.md` beside the citing document,
  `../NAME.md` above it, `[docs/NAME.md](docs/NAME.md)`, `README`), then
  `, "Title"`, ` "Title"`, ` ("Title"` or `'s "Title"`, and any further `, "Title"`s; a title may run over lines
  (each line's indentation and comment marker are dropped). The document has a markdown heading whose text is the
  title, or the title and a trailing parenthesis (`## The encoder (`vae_kernel.encoder`, ...)` answers "The encoder").
- a file: a path with at least one folder, ending in .py, .md, .sh, .yaml, .json, .toml, .txt, .cu, .cpp or .h
  (`bench/budget.py`, `docs/design/pan2.md`), or, in a document, a path from `../`; the file exists, and a `:LINE` after
  it is at most its line count. Its first folder is one at the repository's root (`bench/`, `gpu_check/`, ...), or a
  folder of the tree (fastvideo_integration/compat/seams.py: some `fastvideo_integration/` folder holds
  compat/seams.py), or neither: then the path is read from the root, so a folder that no longer exists (`tools/`) is a
  missing file, not a silent pass. Not citations of this repository: a path whose first folder is named in `EXTERNAL`
  (another project's package, `fastvideo/...`, `ray/...`; a checkpoint's folder, `vae/config.json`), a path in a dated
  record under bench/results/ whose first folder is in no part of the tree (it quotes the tree of its date), URLs (a
  path is never read right after a `/`, so never inside one), placeholders (`<date>`, `*`, `X.json`, `DATE`), and a bare
  `name.py:LINE` (another project's file, FastVideo's).
- a module path: a dotted name in backquotes whose leading parts end the dotted path of one of the tree's modules
  (`stages`, `fastvideo_integration.stages`, `fastvideo_pan2_ext.fastvideo_integration.stages`; the longest such). The next part is a
  name the module binds at its top level (for a module with a `__getattr__`, also a name its tables list), and the
  part after a class without bases a name the class defines (a class with bases may inherit it: not checked). A
  dotted name that starts with no module of the tree (`torch.equal`, `WanVAEDecoder.last_plan`) is not checked.
"""

from __future__ import annotations

import ast
import bisect
import functools
import os
import re
from pathlib import Path

THIS = Path(__file__).resolve()
REPO = THIS.parents[2]
SKIPPED = {".venv", ".git", "out", "build", "dist", "__pycache__", ".pytest_cache", ".whl", ".gl"}
SUFFIXES = (".py", ".md", ".yaml", ".sh")


def _walk(follow_links: bool):
    for folder, dirs, files in os.walk(REPO, followlinks=follow_links):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED and not d.endswith(".egg-info")
                         and (follow_links or not os.path.islink(os.path.join(folder, d))))
        yield Path(folder), dirs, files


@functools.cache
def cited_files() -> tuple[Path, ...]:
    """The files whose citations are checked, each once (a link such as `fastvideo_pan2_ext/vae_kernel` is not
    followed), but this one: its own examples are planted mistakes."""
    return tuple(Path(folder) / f for folder, _, files in _walk(False) for f in sorted(files)
                 if f.endswith(SUFFIXES) and not (Path(folder) / f).is_symlink() and Path(folder) / f != THIS)


@functools.cache
def modules() -> dict[str, Path]:
    """Every Python module of the tree by dotted path from the root, links followed (`fastvideo_pan2_ext.vae_kernel`
    and `vae_kernel` alike)."""
    found = {}
    for folder, _, files in _walk(True):
        for f in files:
            if f.endswith(".py"):
                parts = list((folder / f).relative_to(REPO).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                if parts and all(p.isidentifier() for p in parts):
                    found[".".join(parts)] = folder / f
    return found


@functools.cache
def modules_by_ending() -> dict[str, tuple[Path, ...]]:
    """Each module under every ending of its dotted path (`stages`, `fastvideo_integration.stages`, ...)."""
    found: dict[str, list[Path]] = {}
    for name, module in modules().items():
        parts = name.split(".")
        for start in range(len(parts)):
            found.setdefault(".".join(parts[start:]), []).append(module)
    return {ending: tuple(files) for ending, files in found.items()}


@functools.cache
def folders_by_name() -> dict[str, tuple[Path, ...]]:
    found: dict[str, list[Path]] = {}
    for folder, dirs, _ in _walk(True):
        for d in dirs:
            found.setdefault(d, []).append(folder)
    return {name: tuple(parents) for name, parents in found.items()}


# ---------------------------------------------------------------------------------------------------------------
# Sections


@functools.cache
def headings(doc: Path) -> frozenset[str]:
    """The titles a citation may use for `doc`'s headings: each heading's text, and that text without a trailing
    parenthesis."""
    titles = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = re.match(r"#+ +(.+?) *#* *$", line)
        if match and not fenced:
            title = match.group(1)
            titles.add(title)
            if title.endswith(")") and " (" in title:
                titles.add(title[:title.rindex(" (")])
    return frozenset(titles)


def flattened(path: Path, text: str) -> tuple[str, list[int]]:
    """`path`'s text with each line's indentation (and, outside markdown, its leading comment marker) dropped and its
    lines joined by one space, so that a title run over lines reads as one; and the offset where each line starts."""
    lines, starts = [], []
    offset = 0
    for line in text.splitlines():
        line = line.strip()
        if path.suffix != ".md":
            line = re.sub(r"^#+ ?", "", line)
        starts.append(offset)
        lines.append(line)
        offset += len(line) + 1
    return " ".join(lines), starts


DOCUMENT = (r"(?:\[(?P<linked>(?:\.\./|docs/)?(?:[\w-]+/)*[\w-]+\.md)\]\([^)\s]*\)"
            r"|(?<![\w/.-])(?P<plain>(?:\.\./|docs/)?(?:[\w-]+/)*[\w-]+\.md)"
            r"|(?<![\w/.-])(?P<readme>README)(?![\w.]))")
TITLES = r'(?:, ?| \(| |\'s )(?P<titles>"[^"]+"(?:, ?"[^"]+")*)'
SECTION_CITATION = re.compile(DOCUMENT + TITLES)


def cited_document(name: str, citing: Path) -> Path:
    if name == "README":
        return REPO / "README.md"
    if name.startswith(("docs/", "../")):
        return (REPO / name) if name.startswith("docs/") else (citing.parent / name).resolve()
    return citing.parent / name if (citing.parent / name).exists() else REPO / name


def section_citations(path: Path, text: str | None = None):
    """(line, document as written, document's path, title) for each section `path` (its text: `text`) cites."""
    text, starts = flattened(path, path.read_text() if text is None else text)
    for match in SECTION_CITATION.finditer(text):
        name = match.group("linked") or match.group("plain") or match.group("readme")
        line = bisect.bisect_right(starts, match.start())
        for title in re.findall(r'"([^"]+)"', match.group("titles")):
            yield line, name, cited_document(name, path), title


def broken_section_citations(path: Path, text: str | None = None) -> list[str]:
    broken = []
    for line, name, doc, title in section_citations(path, text):
        where = f"{path.relative_to(REPO)}:{line}"
        if not doc.is_file():
            broken.append(f'{where}: {name}, "{title}": no such document')
        elif title not in headings(doc):
            broken.append(f'{where}: {name}, "{title}": no such heading in {doc.relative_to(REPO)}')
    return broken


# ---------------------------------------------------------------------------------------------------------------
# Files

FILE_CITATION = re.compile(r"(?<![\w/.$~-])(?P<path>(?:\.\./)*[\w.-]+(?:/[\w.-]+)+\.(?:py|md|sh|yaml|json|toml|txt|"
                           r"cu|cpp|h))(?::(?P<line>\d+))?(?![\w/])")
PLACEHOLDER = re.compile(r"(?:^|[/-])(?:[A-Z]+|DATE)(?=[.-])")
RESULTS = REPO / "bench" / "results"
# First folders of paths that are not this repository's: other projects' packages and folders (FastVideo, diffusers
# and its modular_pipelines, Ray, pybind11, CUTLASS's include/, a wheel's .dist-info/), and a checkpoint's folders.
EXTERNAL = frozenset({"fastvideo", "diffusers", "modular_pipelines", "transformers", "torch", "ray", "pybind11",
                      "include", ".dist-info", "vae", "transformer", "text_encoder", "tokenizer", "scheduler"})


def cited_file(path: str, citing: Path) -> Path | None:
    """The file `path` names, or None where it is not a citation of this repository. `path` names a missing file
    where the result does not exist."""
    if PLACEHOLDER.search(path):
        return None
    if path.startswith("../"):
        return (citing.parent / path).resolve() if citing.suffix == ".md" else None
    first = path.split("/")[0]
    if (REPO / first).exists():
        return REPO / path
    parents = folders_by_name().get(first, ())
    for parent in parents:
        if (parent / path).exists():
            return parent / path
    if parents:
        return parents[0] / path
    if first in EXTERNAL or RESULTS in citing.parents:
        return None
    return REPO / path


def broken_file_citations(path: Path, text: str | None = None) -> list[str]:
    broken = []
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        for match in FILE_CITATION.finditer(line):
            target = cited_file(match.group("path"), path)
            if target is None:
                continue
            where = f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
            if not target.exists():
                broken.append(f"{where}: no such file")
            elif match.group("line") and int(match.group("line")) > len(target.read_text().splitlines()):
                broken.append(f"{where}: past the file's end")
    return broken


# ---------------------------------------------------------------------------------------------------------------
# Module paths

MODULE_PATH = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)`")
NOT_MODULE_PATHS = {"py", "md", "sh", "yaml", "json", "toml", "txt", "pt", "pth", "mp4", "safetensors", "cu", "cpp",
                    "h", "so", "jpg", "png"}  # a file's name (`fa4.py`, `z.pt`), not a module path


@functools.cache
def defined_names(module: Path) -> tuple[frozenset[str], dict[str, frozenset[str] | None]]:
    """The names `module` defines at its top level, and for each class without bases the names it defines (for a
    class with bases, None)."""
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    classes: dict[str, frozenset[str] | None] = {}

    def bind(target):
        if isinstance(target, ast.Name):
            names.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bind(element)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.ClassDef):
                names.add(node.name)
                classes[node.name] = None if node.bases else _class_names(node)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody"):
                    visit(getattr(node, block, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    if "__getattr__" in names:  # names served lazily: those its tables (`__all__`, `_EXPORTS`) list
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                names.update(c.value for c in ast.walk(node.value)
                             if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return frozenset(names), classes


def _class_names(node: ast.ClassDef) -> frozenset[str]:
    names = set()
    for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(item.name)
        elif isinstance(item, ast.Assign):
            names.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    for child in ast.walk(node):  # self.x = ...
        if isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store) \
                and isinstance(child.value, ast.Name) and child.value.id == "self":
            names.add(child.attr)
    return frozenset(names)


def module_path_problem(dotted: str) -> str | None:
    """Why `dotted` names nothing in this repository, or None (also where it is not a module path of it)."""
    parts = dotted.split(".")
    if parts[-1] in NOT_MODULE_PATHS:
        return None
    for length in range(len(parts), 0, -1):
        prefix = ".".join(parts[:length])
        candidates = modules_by_ending().get(prefix)
        if candidates:
            break
    else:
        return None
    if length == len(parts):
        return None
    name = parts[length]
    defining = [f for f in candidates if name in defined_names(f)[0]]
    if not defining:
        return f"no module {'.'.join(parts[:length + 1])} and no {name} in {'.'.join(parts[:length])}"
    if length + 1 < len(parts):
        attribute = parts[length + 1]
        members = [defined_names(f)[1].get(name) for f in defining]
        if name in defined_names(defining[0])[1] and all(m is not None and attribute not in m for m in members):
            return f"class {'.'.join(parts[:length + 1])} defines no {attribute}"
    return None


def broken_module_paths(path: Path, text: str | None = None) -> list[str]:
    broken = []
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(), 1):
        for match in MODULE_PATH.finditer(line):
            problem = module_path_problem(match.group(1))
            if problem:
                broken.append(f"{path.relative_to(REPO)}:{number}: `{match.group(1)}`: {problem}")
    return broken


# ---------------------------------------------------------------------------------------------------------------


def test_every_cited_section_exists():
    broken = [b for f in cited_files() for b in broken_section_citations(f)]
    assert not broken, "\n".join(broken)


def test_every_cited_file_exists():
    broken = [b for f in cited_files() for b in broken_file_citations(f)]
    assert not broken, "\n".join(broken)


def test_every_cited_module_path_exists():
    broken = [b for f in cited_files() for b in broken_module_paths(f)]
    assert not broken, "\n".join(broken)


def test_the_checks_see_the_forms_in_use():
    """Each form a citation takes in this repository is read, and a wrong one is named (in a text read as if it were a
    file of the tree; nothing is written)."""
    citing = REPO / "bench" / "planted_citations.py"
    lines = ['"""docs/design.md, "Definitions"; docs/design/decoder.md "Winograd"; docs/design.md ("Rooms");',  # 1
             'docs/design/worker.md, "Out-of-memory',  # 2
             '    retries", "One fallback policy"; [docs/diffusers.md](docs/diffusers.md),',  # 3
             '"`enable_fast_encode`"; README, "Serving"; README\'s "Try it"; docs/fastvideo.md, "Scaling out".',  # 4
             'docs/design.md, "No such section"; docs/nowhere.md, "Rooms"; the bar ("VAE decode");'
             ' docs/design/pan2.md, "Winograd"',  # 5
             "tests/repo/test_docs_citations.py:1 gpu_check/no_such_script.py fastvideo_integration/no_such.py "
             "fastvideo_integration/compat/seams.py",  # 6
             "tests/repo/test_docs_citations.py:100000 bench/results/X.json component_loader.py:778 ../x/y.py "
             "tools/make_gpu_bundle.sh vae/config.json fastvideo/models/loader/component_loader.py",  # 7
             "`vae_kernel.definitions.precision.exact_fp32` `vae_kernel.precision.exact_fp32` `memory.retry_plan`",  # 8
             "`memory.no_such_plan` `torch.equal` `fa4.py` `fastvideo_pan2_ext.vae_kernel.WanVAEDecoder`",  # 9
             "`weights.PreparedWeights.no_such_method` `bands.RankRows.check_peers`",  # 10
             '"""']
    text = "\n".join(lines) + "\n"
    sections = [(line, title) for line, _, _, title in section_citations(citing, text)]
    assert sections == [(1, "Definitions"), (1, "Winograd"), (1, "Rooms"), (2, "Out-of-memory retries"),
                        (2, "One fallback policy"), (3, "`enable_fast_encode`"), (4, "Serving"), (4, "Try it"),
                        (4, "Scaling out"), (5, "No such section"), (5, "Rooms"), (5, "Winograd")]
    assert broken_section_citations(citing, text) == [
        'bench/planted_citations.py:5: docs/design.md, "No such section": no such heading in docs/design.md',
        'bench/planted_citations.py:5: docs/nowhere.md, "Rooms": no such document',
        'bench/planted_citations.py:5: docs/design/pan2.md, "Winograd": no such heading in docs/design/pan2.md']
    assert broken_file_citations(citing, text) == [
        "bench/planted_citations.py:5: docs/nowhere.md: no such file",
        "bench/planted_citations.py:6: gpu_check/no_such_script.py: no such file",
        "bench/planted_citations.py:6: fastvideo_integration/no_such.py: no such file",
        "bench/planted_citations.py:7: tests/repo/test_docs_citations.py:100000: past the file's end",
        "bench/planted_citations.py:7: tools/make_gpu_bundle.sh: no such file"]
    assert broken_module_paths(citing, text) == [
        ("bench/planted_citations.py:8: `vae_kernel.precision.exact_fp32`: no module vae_kernel.precision and no "
         "precision in vae_kernel"),
        "bench/planted_citations.py:8: `memory.retry_plan`: no module memory.retry_plan and no retry_plan in memory",
        ("bench/planted_citations.py:9: `memory.no_such_plan`: no module memory.no_such_plan and no no_such_plan in "
         "memory"),
        ("bench/planted_citations.py:10: `weights.PreparedWeights.no_such_method`: class weights.PreparedWeights "
         "defines no no_such_method")]
