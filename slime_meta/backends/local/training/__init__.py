"""The torch trainer of the local backend: built from the config (`setup`, `settings`, its memory plan in `plan`,
the GPU split with the workers in `gpu_split`), the train step (`trainer`), the loss channels (`channels`) over
sequences (`batching`) and shared-prompt rows (`packing`, `varlen_attention`), the model call (`model_call`), the
start weights (`reference`), steps with no gradient (`no_signal`), where a step's time goes (`timing`)."""
