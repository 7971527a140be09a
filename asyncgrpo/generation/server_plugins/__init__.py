"""Modules that `asyncgrpo serve` puts on the vLLM server's own PYTHONPATH: each is a top-level
module there (this folder is the path entry), imports the standard library only, and so loads in a
server environment that lacks asyncgrpo. This file only makes the folder part of the package."""
