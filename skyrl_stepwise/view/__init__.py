"""The trajectory viewer: a static page per run (view/index.html) built only from what the run recorded."""
