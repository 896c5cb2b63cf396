"""Runtime: process groups over a mesh, autograd-aware collectives, gradient sync, state dicts, launch helpers."""
