"""arith_agent: an example harbor-exec workflow project (workflow + grader)."""

__version__ = "0.1.0"
