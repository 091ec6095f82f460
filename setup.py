"""Ship the repository's configs, tokenizer specs and Slurm templates inside the wheel.

They live at the repository root for users of the source tree (``configs/train/demo.yaml``);
``build_py`` copies them to ``tape_train/_resources/`` of the built package, where
``tape_train.resources.resource_dir`` finds them after a non-editable install. Everything else
is declared in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# packaged name (tape_train/_resources/<name>) -> source directory; keep in step with
# tape_train/resources.py SOURCE_DIRS
RESOURCES = {
    "configs_model": "configs/model",
    "configs_data": "configs/data",
    "configs_train": "configs/train",
    "configs_experiments": "configs/experiments",
    "configs_lm_eval": "configs/lm_eval",
    "tokenizer": "tokenizer",
    "slurm": "launch/slurm",
}


class BuildWithResources(build_py):
    def run(self):
        super().run()
        for name, source in RESOURCES.items():
            target = Path(self.build_lib) / "tape_train" / "_resources" / name
            shutil.rmtree(target, ignore_errors=True)
            skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.model", "*.vocab",
                                          "*.training.json")  # trained tokenizers stay local
            shutil.copytree(ROOT / source, target, ignore=skip)


setup(cmdclass={"build_py": BuildWithResources})
