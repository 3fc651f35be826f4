"""The local backend: the whole loop on one machine.

run         the outer loop (draw, rollout, train, push weights, log, evaluate, save)
inputs      input checks before anything starts; the run directory
data        the problems, eval sets and batch plan, checked against the models' contexts
evaluation  the evaluations without training on the fixed eval sets
step/       one outer step: what a rollout hands to training, rollouts ahead of training, the step's metrics
training/   the torch trainer: its setup and memory plan, the loss channels, packed rows, the reference
workers/    the embedded workers and their routers: pools, processes, restarts, the weight push, --grader local
"""
