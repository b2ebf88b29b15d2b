"""Recorded py-spy output shared by the stack tests."""
# Recorded `py-spy record --format raw --threads --idle` output of a training rank.
RAW_ALL = """\
thread (4242): MainThread;<module> (train.py:120);main (train.py:98);backward (torch/_tensor.py:625) 31
thread (4242): MainThread;<module> (train.py:120);main (train.py:93);__next__ (torch/utils/data/dataloader.py:733) 9
thread (4250): trainscope-exporter;_bootstrap (threading.py:1002);_run (exporter.py:259);wait (threading.py:331) 40
thread (0x7F00AB): ;weird (x.py:1) 2
garbage line
"""
# The same window without --idle: only samples where the thread was running.
RAW_ACTIVE = """\
thread (4242): MainThread;<module> (train.py:120);main (train.py:98);backward (torch/_tensor.py:625) 30
thread (4242): MainThread;<module> (train.py:120);main (train.py:93);__next__ (torch/utils/data/dataloader.py:733) 9
"""
