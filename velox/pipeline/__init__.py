"""The pipeline: one worker process running the stages in order (`worker.Worker`)."""
