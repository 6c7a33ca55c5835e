"""The batch library: a JSONL or text input made into requests (requests.py, with input_lines.py's bounded
reading and line_tools.py's tool fields), one line queued on an engine (submit.py), results gathered per
line (line_results.py) and written to a results file that resumes only what matches (results_file.py,
results_writer.py, side_files.py). `pagecli generate` (cli), `pagecli serve`'s batch endpoints (serve) and
the Ray workers (cluster) all use it; it imports the engine's layer and below, never a front end.
"""
