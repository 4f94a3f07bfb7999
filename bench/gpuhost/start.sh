# On the device: start bench/fidelity.py for one model in the background (a new session, so
# it outlives the call), pinned to CPUS. bash bench/gpuhost/start.sh MODEL CPUS REPEAT
# Its log, JSON and kept runs: /tmp/res/MODEL.log, /tmp/res/fidelity_MODEL.json, /tmp/keep_MODEL.
model=$1 cpus=$2 repeat=${3:-3}
. "$(dirname "$0")/env.sh"
setsid -f bash -c "cd /tmp/repo && taskset -c $cpus python3 bench/fidelity.py --models $model --repeat $repeat \
  --keep /tmp/keep_$model --out /tmp/res/fidelity_$model.json > /tmp/res/$model.log 2>&1 < /dev/null; \
  echo exit=\$? >> /tmp/res/$model.log"
sleep 20; cat /tmp/res/$model.log; uptime
