"""Offline batch jobs: `python -m service.batch` answers a file of requests (OpenAI's Batch JSONL, for the OpenAI and
the native routes) or translates a text file, through the service's own app in-process (`__main__` says how)."""
