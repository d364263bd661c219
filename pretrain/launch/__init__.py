"""What starts and supervises the ranks of a job: launch.sh's Python side."""
