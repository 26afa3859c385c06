"""Schedulers between the serving layer and the engines; each module imports only those listed before it:

- jobs.py: what a serving module submits (`TextJob`, `ImageJob`) and what one step hands back (`Generation`);
- queueing.py: the bounded queue both schedulers share, admission, Retry-After, gauges, stop;
- text_batch.py: the running batch of the text models, the one place that steps the searches;
- continuous.py: continuous (iteration-level) batching for the text models;
- dynamic.py: dynamic (request-level) batching for the images.
"""
