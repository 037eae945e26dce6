from setuptools import find_packages, setup

extras = {
    "te": ["transformer-engine"],
    "tensorboard": ["tensorboard"],
    "wandb": ["wandb"],
    "swanlab": ["swanlab"],
    "mlflow": ["mlflow"],
    "plot": ["matplotlib"],
    # matplotlib: the tests render a run's charts.
    "test": ["pytest>=7", "ruff>=0.5", "matplotlib"],
}
extras["dev"] = extras["test"]

setup(
    name="twinkle-megatron",
    version="0.1.0",
    description="Megatron-aware training metrics: Twinkle's metric API, correct under TP/PP/CP/DP.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["twinkle_megatron", "twinkle_megatron.*"]),
    # The device-check record the Triton kernel's selection reads (written by `make gpu-check`).
    package_data={"twinkle_megatron.ops": ["kernel_checks.json"]},
    python_requires=">=3.10",
    # No version pin on torch: installing this package must never pull a new torch.
    install_requires=["torch>=2.1", "megatron-core>=0.13"],
    extras_require=extras,
    entry_points={"console_scripts": ["twinkle-megatron=twinkle_megatron.cli:main"]},
)
