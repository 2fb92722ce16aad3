"""Everything is in pyproject.toml; this file only adds one build step: the wheel carries
``rollout_tracer_verl.pth`` at its top level, so installing it puts the file into
site-packages, where Python runs its line at every interpreter start (tracer/verl_switch.py
says what the line does; it does nothing unless ROLLOUT_TRACER_VERL is set)."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "rollout_tracer_verl.pth"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tracer", PTH)


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(SOURCE, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
