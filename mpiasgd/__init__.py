"""mpiasgd: asynchronous SGD for convolutional networks over MPI.

Rank 0 is the parameter server; ranks 1..N are workers. See README.md for the commands.
"""

__version__ = "0.1.0"
