"""The attnlab command line: a thin client over the library."""
