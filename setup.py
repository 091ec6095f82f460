"""Ship the repository's configs, tokenizer specs and Slurm templates inside the wheel.

They live at the repository root for users of the source tree (``configs/train/demo.yaml``);
``build_py`` copies them to ``tape_train/_resources/`` of the built package, where
``tape_train.resources.resource_dir`` finds them after a non-editable install. Everything else
is declared in pyproject.toml.
"""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# resource name -> source directory: the one table, in tape_train/resources.py (read without
# importing the package, which a build environment may not be able to do)
SOURCE_DIRS = runpy.run_path(str(ROOT / "tape_train" / "resources.py"))["SOURCE_DIRS"]


class BuildWithResources(build_py):
    def run(self):
        super().run()
        for name, source in SOURCE_DIRS.items():
            target = Path(self.build_lib) / "tape_train" / "_resources" / name.replace("/", "_")
            shutil.rmtree(target, ignore_errors=True)
            skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.model", "*.vocab",
                                          "*.training.json")  # trained tokenizers stay local
            shutil.copytree(ROOT / source, target, ignore=skip)


setup(cmdclass={"build_py": BuildWithResources})
