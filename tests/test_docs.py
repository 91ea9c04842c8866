"""The docs site builds strictly, and every command, config key and repo path the docs name still exists."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    """A module of docs/ (not a package), loaded by path."""
    spec = importlib.util.spec_from_file_location(f"skyrl_docs_{name}", ROOT / "docs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


checker = _load("check_commands")
reference = _load("gen_config_reference")


@pytest.fixture(scope="module")
def facts():
    return checker.load_facts(ROOT)


def _build(config_file: Path, site_dir: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(config_file=str(config_file), site_dir=str(site_dir), strict=True))


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_the_site_builds_strictly(tmp_path):
    _build(ROOT / "mkdocs.yml", tmp_path / "site")
    page = (tmp_path / "site" / "config-reference" / "index.html").read_text()
    assert "trainer.lora.enabled" in page and "generator.context.policy" in page


@pytest.mark.integration  # slow for the fast suite (> 2 s on a loaded 2-core box)
def test_a_broken_link_or_a_page_left_out_of_the_nav_fails_the_build(tmp_path):
    """Our mkdocs.yml's validation settings turn these into errors (mkdocs only logs them by default)."""
    from mkdocs.exceptions import Abort

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.pop("hooks")
    docs = tmp_path / "docs"
    docs.mkdir()
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}, {"Other": "other.md"}])
    (docs / "other.md").write_text("# Other\n")
    for index, extra in [("# Home\n\nSee [gone](missing.md).\n", None),
                         ("# Home\n\nSee [other](other.md#no-such-heading).\n", None),
                         ("# Home\n", "orphan.md")]:
        (docs / "index.md").write_text(index)
        if extra:
            (docs / extra).write_text("# Orphan\n")
        (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
        with pytest.raises(Abort):
            _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    (docs / "orphan.md").unlink()
    _build(tmp_path / "mkdocs.yml", tmp_path / "site")  # and without the defect it builds


def test_every_command_key_and_path_in_the_docs_exists(facts):
    assert checker.check_docs(ROOT, facts) == []


@pytest.mark.parametrize("markdown, stale", [
    ("```bash\nskyrl-stepwise trian experiment=search_r1_tiny\n```", "skyrl-stepwise trian"),
    ("```bash\npython -m skyrl_stepwise.no_such_module --help\n```", "no such module"),
    ("`python -m skyrl_stepwise.trainer_gone experiment=x`", "no such module"),
    ("```bash\nmake runn\n```", "no target runn"),
    ("```bash\nmake test NO_SUCH_VAR=1\n```", "no variable NO_SUCH_VAR"),
    ('`make run ARGS="trainer.lora.enabld=true"`', "no `enabld` in trainer.lora"),
    ("```bash\nskyrl-stepwise train experiment=search_r1_tiny trainer.packingg=tree\n```", "no `packingg` in trainer"),
    ("```bash\nPYTHONPATH=. skyrl-stepwise train \\\n    experiment=search_r1_tiny \\\n    generator.no_key=1\n```",
     "no `no_key` in generator"),
    ("```bash\nskyrl-stepwise train experiment=no_such_recipe\n```", "no conf/experiment/no_such_recipe.yaml"),
    ("Set `trainer.algorithm.gamma_typo` to 0.9.", "no `gamma_typo` in trainer.algorithm"),
    ("Try `sft.lrr=1e-5`.", "no `lrr` in sft"),
    ("See `skyrl_stepwise/no_room/store.py`.", "path skyrl_stepwise/no_room/store.py"),
    ("Tested by tests/test_no_such_file.py::test_x.", "path tests/test_no_such_file.py"),
    ("```bash\npython benchmarks/no_such_bench.py --n 3\n```", "benchmarks/no_such_bench.py"),
    ("In `policy/no_such_module.py`.", "path policy/no_such_module.py"),
    ("Typed by `skyrl_stepwise.no_such_room.config.RunConfig`.", "no module skyrl_stepwise.no_such_room"),
    ("Subclass `skyrl_stepwise.envs.gone:Env`.", "no module skyrl_stepwise.envs.gone"),
])
def test_the_checker_fails_on_a_stale_command_key_or_path(facts, markdown, stale):
    errors = checker.check_markdown(markdown, facts, "page.md")
    assert errors and stale in errors[0], errors


def test_the_checker_passes_what_exists(facts):
    markdown = "\n".join([
        "```bash",
        "make run ARGS=\"trainer.lora.enabled=true\"   # a comment with key=value words",
        "make test VLLM_EXTRA=gpu",
        "PYTHONPATH=examples/own_task skyrl-stepwise train experiment=tool_task_tiny \\",
        "    +environment.env_classes.guess=guess:GuessEnv environment.env_classes.other=x:Y \\",
        "    hydra.run.dir=outputs/x trainer.seed=1,2 data.train_path=...",
        "skyrl-stepwise model prepare --gguf my.gguf",
        "python benchmarks/chaos.py --noise-run && pytest -m own_model tests/test_docs.py",
        "```",
        "`trainer.lora.rank`, `generator.context.*`, `sft.parquet`, `examples/own_task/`, `train/forward_tokens`.",
        "`skyrl_stepwise.tools.Tool`, `skyrl_stepwise.envs.humaneval:HumanEvalEnv`, `skyrl_stepwise.cli.COMMANDS`.",
    ])
    assert checker.check_markdown(markdown, facts) == []


def _leaf_keys(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def test_the_config_reference_lists_every_key_with_its_comment():
    run_config = reference.run_config_class()
    page = reference.render(run_config)
    keys = list(_leaf_keys(run_config))
    assert len(keys) > 100
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert missing == []
    row = next(line for line in page.splitlines() if line.startswith("| `engine.cpu_kvcache_gib` |"))
    assert "KV cache" in row  # the field's comment
    row = next(line for line in page.splitlines() if line.startswith("| `trainer.model_path` |"))
    assert "${model_path}" in row  # conf/config.yaml's value where it differs from the schema's


def test_every_config_key_has_a_description():
    """84 of 209 keys once had an empty description cell (trainer.lora.enabled, generator.step_wise_trajectories):
    a key added without a comment beside its field fails here, by name."""
    undocumented = [key for _, _, rows in reference.sections(reference.run_config_class(), "", {})
                    for key, _, _, _, comment in rows if not comment.strip()]
    assert undocumented == [], f"config keys without a comment beside their field: {undocumented}"


def test_an_inherited_field_is_described_by_the_class_that_declares_it():
    """SearchEnvConfig inherits its retriever keys from RetrieverEndpointConfig: their comments live there, and the
    reference once showed them blank (environment.search.retriever_down's 'fail ... or observe' among them)."""
    rows = {key: comment for _, _, section in reference.sections(reference.run_config_class(), "", {})
            for key, _, _, _, comment in section}
    assert "observe" in rows["environment.search.retriever_down"]
    assert "documents returned per search" in rows["environment.search.topk"]
