"""Quantization, conversion and quality measurement on top of the edgellm core."""
