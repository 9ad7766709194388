from setuptools import find_packages, setup

setup(
    name="kltron",
    version="0.1.0",
    description="Megatron-style RL fine-tuning trainer with a correct, cheap KL penalty",
    packages=find_packages(include=["core", "core.*", "parallel", "parallel.*", "rl", "rl.*",
                                "tools", "tools.*"]),
    package_data={"core": ["data/*.txt", "data/*.model", "data/*.jsonl"],
                  "parallel": ["csrc/*.cpp"]},  # the batch-invariant attention kernel, built on first use
    include_package_data=True,
    license="Apache-2.0",
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "numpy",
        "pyyaml",
        "tokenizers>=0.19",  # HF tokenizer.json (byte-level BPE) checkpoints
        "jinja2>=3.1.6",  # chat templates
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-xdist>=3.6", "ruff>=0.6", "transformers>=4.45", "matplotlib", "hypothesis",
                "ninja"],
        # the batch-invariant mode's CPU attention kernel is compiled on first use (with a system C++ compiler)
        "kernel": ["ninja"],
        "plot": ["matplotlib"],
        "data": ["pyarrow"],  # Parquet prompt sets
        "peft": ["peft", "transformers>=4.45"],  # tools.convert_hf export --peft, checked by tests with peft
        "math": ["math-verify"],  # symbolic answer equality in rl.experience.math_reward
        "tensorboard": ["tensorboard"],  # monitor.tensorboard=true (core/runtime/monitor.py)
        # monitor.wandb=offline; not in dev: a 20 MB wheel, 62 MB installed (a Go binary), 14+ dependencies
        "wandb": ["wandb"],
    },
)
