"""Sane upper bounds on the counts that options of several command lines and the training options share."""

MAX_BATCH = 2**20  # images in one batch: a thousand times the release's largest per-GPU batch
MAX_WORKERS = 1024  # data-loading processes per GPU
MAX_THREADS = 1024  # PyTorch's CPU threads per process
MAX_PROCESSES = 1024  # ranks one command line starts on its machine (train_edm2.py --processes)
# Each rank holds its own copy of the network, Adam's moments and the EMA tracks, and its own PyTorch runtime
# (about 0.3 GB): by default no more ranks than this, the cores shared out as threads among them.
MAX_DEFAULT_PROCESSES = 8
MAX_IMAGES = 10**8  # images to read, write or generate: dataset file names number them with 8 digits
