#!/usr/bin/env bash
# Growth rows of the full Fashion-MNIST stopping experiment, one run at a time (resumable: a
# finished row is skipped, a cut one resumes from its last epoch checkpoint).
#   experiments/full_growth.sh SEED [extra growtrain overrides...]
exec "$(dirname "${BASH_SOURCE[0]}")/full_stopping.sh" growth "$1" --skip_scratch=true "${@:2}"
