"""The jobs the command line runs: their settings, their run directories, the training job."""
