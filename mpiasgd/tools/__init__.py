"""Offline tools: they read run logs (and write snapshot evaluations into them) after or beside a run.
The runtime (train, server, workers) never imports this package.

    evaluate.py   mpiasgd evaluate RUN.h5       top-1 and top-5 accuracy of every weight snapshot, stored in the log
    report.py     mpiasgd report RUN.h5 [...]   summary tables, runs compared (text, markdown, csv)
    plots.py      mpiasgd report ... --plots    PNG plots of accuracy, loss, staleness, time split
    watch.py      mpiasgd watch RUN.h5          follow a running job, a line per interval and per evaluation
                                                during training (--eval-interval), with the accuracy curve
    trace.py      mpiasgd trace RUN.h5          Chrome trace, one track per rank
"""
