import re

from setuptools import find_packages, setup

# one version, trunksplit.__version__'s: what `trunksplit --version` reads back from the installed metadata
VERSION = re.search(r'^__version__ = "([^"]+)"', open("trunksplit/__init__.py").read(), re.M).group(1)

setup(
    name="trunksplit",
    version=VERSION,
    description="Train vision backbones with far less activation memory and exactly the same gradients: planned activation checkpointing for SSL.",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["trunksplit", "trunksplit.*"]),
    python_requires=">=3.10",  # dataclass(kw_only=True)
    install_requires=["torch>=2.12", "torchvision>=0.27", "numpy", "fvcore", "PyYAML", "tabulate", "tqdm", "matplotlib"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist"],
        "zoo": ["timm", "transformers"],  # the timm and transformers tests, tools/zoo_sweep.py
        "clients": ["lightning", "lightly", "timm", "transformers", "accelerate", "tensorboard"],  # docs/integrations.md and its tests
        "digits": ["scikit-learn"],  # tools/digits_folder.py: the handwritten digits it ships
        "tensorboard": ["tensorboard"],  # LOGGING.TENSORBOARD True: scalars beside metrics.jsonl
    },
    entry_points={"console_scripts": ["trunksplit=trunksplit.cli:main"]},
)
