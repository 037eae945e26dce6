import re

from setuptools import find_packages, setup

# One version, in the package's version module (twinkle_megatron.__version__, `twinkle-megatron --version`).
VERSION = re.search(r'^__version__ = "([^"]+)"', open("twinkle_megatron/version.py", encoding="utf-8").read(),
                    re.M).group(1)

extras = {
    # Transformer Engine's PyTorch bindings: the bare package has none.
    "te": ["transformer-engine[pytorch]"],
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
    "swanlab": ["swanlab"],
    "mlflow": ["mlflow"],
    "plot": ["matplotlib"],
    # matplotlib: the tests render a run's charts; pytest-xdist: `make test` runs them on two worker processes.
    "test": ["pytest>=7", "pytest-xdist>=3", "ruff>=0.5", "matplotlib"],
}
extras["dev"] = extras["test"]

setup(
    name="twinkle-megatron",
    version=VERSION,
    description="Megatron-aware training metrics: Twinkle's metric API, correct under TP/PP/CP/DP.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    # In the wheel's .dist-info: the licence, and the NOTICE crediting the designs this one follows.
    license_files=["LICENSE", "NOTICE"],
    packages=find_packages(include=["twinkle_megatron", "twinkle_megatron.*"]),
    # The device-check record the Triton kernel's selection reads (written by `twinkle-megatron kernel-check`).
    package_data={"twinkle_megatron.ops": ["kernel_checks.json"]},
    python_requires=">=3.10",
    # No version pin on torch: installing this package must never pull a new torch. megatron-core: the
    # releases the suite ran and passed on (docs/versions.md); pip gives Python 3.11 0.16, Python 3.12 0.19.
    install_requires=["torch>=2.1", "megatron-core>=0.13,<0.20"],
    extras_require=extras,
    entry_points={"console_scripts": ["twinkle-megatron=twinkle_megatron.cli:main"]},
)
