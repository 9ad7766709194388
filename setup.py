from setuptools import setup

setup(
    name="kltron",
    version="0.1.0",
    description="Megatron-style RL fine-tuning trainer with a correct, cheap KL penalty",
    packages=["core", "parallel", "rl", "tools"],
    package_data={"core": ["data/*.txt", "data/*.model"]},
    include_package_data=True,
    license="Apache-2.0",
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "dev": ["pytest>=8", "ruff>=0.6", "transformers>=4.45", "matplotlib"],
        "plot": ["matplotlib"],
    },
)
