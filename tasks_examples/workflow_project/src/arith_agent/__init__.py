"""arith_agent: an example harbor-exec workflow project (workflow.py, and its grader in grader.py)."""

__version__ = "0.1.0"
