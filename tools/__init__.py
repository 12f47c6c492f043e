"""Developer tools: test and benchmark helpers that are not part of the installed package."""
