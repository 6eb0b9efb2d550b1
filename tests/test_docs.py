"""The README and docs/ stay true: every relative link resolves, and every documented command still parses.

A command is parsed by the real argument parser (``trunksplit``'s, ``tools/train.py``'s,
``tools/benchmark.py``'s) and, for the launcher, its config file and ``KEY VALUE``
overrides are loaded and validated; nothing is run.
"""
import importlib.util
import pathlib
import re
import shlex

import pytest

from trunksplit.cli.bench_ddp import build_parser as bench_ddp_parser
from trunksplit.cli.parser import build_parser as cli_parser, parse_with_overrides
from trunksplit.ssl.config import load_config

from docs_pages import PAGES, ROOT, fences as _fences

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def _links():
    for page in PAGES:
        text = _fences(page.read_text())[1]
        for target in LINK.findall(text):
            if not re.match(r"[a-z]+:", target):  # http:, mailto: ...: not ours to check here
                yield page, target


def _commands():
    """(page, command) for each trunksplit, launcher or benchmark call in a code block or span."""
    for page in PAGES:
        text = page.read_text()
        blocks, outside = _fences(text)
        fenced = [body for language, body in blocks if language in ("", "bash", "sh", "console")]
        spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", outside)]
        for block in fenced + spans:
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    part = part.strip().removeprefix("$ ")
                    if re.match(r"(trunksplit (plan|bench|fit|bench-data|knn|report)|python tools/|torchrun )", part):
                        yield page, part


def test_pages_and_links_exist():
    links = list(_links())
    assert len(links) > 10  # the README links its docs; a broken regex would check nothing
    broken = []
    for page, target in links:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []


def test_readme_is_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


def _tool_parser(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_tool", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


@pytest.mark.parametrize("page,command", list(_commands()), ids=lambda v: v if isinstance(v, str) and len(v) < 60 else None)
def test_documented_command_parses(page, command, tmp_path, monkeypatch):
    words = shlex.split(command, comments=True)
    if words[0] == "trunksplit":
        monkeypatch.chdir(tmp_path)  # bench's --out is created as it is parsed
        cli_parser().parse_args(words[1:])
        return
    script = next(w for w in words if w.startswith("tools/"))
    args = words[words.index(script) + 1 :]
    if script in ("tools/wrap_budget.py", "tools/zoo_sweep.py", "tools/fsdp_memory.py", "tools/fsdp_scaling.py", "tools/compile_benchmark.py", "tools/fsdp_compile_benchmark.py", "tools/in_backward_benchmark.py", "tools/digits_folder.py", "tools/library_checkpointing_benchmark.py",
                  "tools/unit_compile_times.py", "tools/gpu_check.py", "tools/multicrop_benchmark.py", "tools/eager_overhead.py", "tools/plan_time.py", "tools/price_check.py", "tools/penalty_peaks.py"):
        _tool_parser(script[len("tools/"):-len(".py")]).parse_args(args)
        return
    if script == "tools/benchmark.py":
        bench_ddp_parser().parse_args(args) if "--ddp" in args else cli_parser().parse_args(["bench"] + args)
        return
    assert script == "tools/train.py", command
    parsed = parse_with_overrides(_tool_parser("train"), args, "overrides")
    load_config(str(ROOT / parsed.config_file), parsed.overrides)  # the file exists, every key and value is valid


def test_a_broken_command_is_caught():
    """The check can fail: an option that does not exist is refused by the same parser."""
    with pytest.raises(SystemExit):
        cli_parser().parse_args(["plan", "--no-such-option"])
    with pytest.raises(ValueError, match="unknown config key"):
        load_config(str(ROOT / "configs/quickstart.yaml"), ["TRAIN.NO_SUCH_KEY", "1"])


SOURCE_PATH = re.compile(r"`((?:trunksplit|tools|configs|tests)/[\w/.]+)`")
SHORT_MODULE = re.compile(r"`(\w+\.py)`")
PUBLIC_NAME = re.compile(r"`(trunksplit(?:\.\w+)+)`")


def test_every_module_path_and_public_name_the_docs_mention_exists():
    """A page that names ``trunksplit/planning/budget.py``, ``select.py`` or ``trunksplit.fit`` names
    something that is there: moved code leaves no stale pointer behind."""
    import importlib

    known_files = {p.name for p in (ROOT / "trunksplit").rglob("*.py")} | {p.name for p in (ROOT / "tools").glob("*.py")} | {"setup.py", "conftest.py"}
    known_files |= {p.name for p in (ROOT / "tests").rglob("*.py")}
    missing, checked = [], 0
    for page in PAGES:
        text = page.read_text()
        for path in SOURCE_PATH.findall(text):
            checked += 1
            if not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.name}: {path}")
        for name in SHORT_MODULE.findall(text):
            checked += 1
            if name not in known_files:
                missing.append(f"{page.name}: {name}")
        for dotted in PUBLIC_NAME.findall(text):
            checked += 1
            parts = dotted.split(".")
            for i in range(len(parts), 0, -1):  # the longest importable module, then attributes
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(f"{page.name}: {dotted}")
    assert checked > 30, checked  # the patterns find what the pages name
    assert missing == [], "the docs name what does not exist:\n" + "\n".join(missing)


def test_the_architecture_page_names_every_module_of_the_package():
    """A newcomer finds any concern from docs/architecture.md: a module added without a line there fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p.relative_to(ROOT / "trunksplit") for p in (ROOT / "trunksplit").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    unnamed = [str(m) for m in modules if f"`{m.name}`" not in text and f"`{m}`" not in text]
    assert unnamed == [], f"docs/architecture.md does not name: {unnamed}"
