"""schedlab: the command line on top of policies, traces, sim and engine."""
__version__ = "0.1.0"
