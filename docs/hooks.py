"""mkdocs hooks: the config reference page is generated at every build, never committed, so it cannot go stale."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.structure.files import File

PAGE = "config-reference.md"


def _generator():
    """docs/gen_config_reference.py, loaded by path: docs/ is not a package."""
    path = Path(__file__).with_name("gen_config_reference.py")
    spec = importlib.util.spec_from_file_location("skyrl_docs_gen_config_reference", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_files(files, config):
    """Add the generated config reference to the site's files, before the nav is resolved against them."""
    files.append(File.generated(config, PAGE, content=_generator().render()))
    return files
