# Both demo towers trained with --pack (eval/train/pack.py) side by side on one H100, from the device copy's root.
# Called twice on one warm machine (each call at most 10 minutes): the second call resumes both runs from their
# checkpoints in /root/runs and finishes their plans. LLAVA_INIT: the shipped demo-llava tower (8.3 min of training
# on its own); demo-internvl starts from a random tower. A run whose compiled start fails is restarted eager.
MIX="scene=0.4,text=0.15,document=0.3,chart=0.15"
STOP=${STOP:-8.0}
R=$OUT/res; mkdir -p $R
train() {  # model, out, extra args...
  local m=$1 o=$2; shift 2
  python3 -m eval.train.towers --model $m --pack --mix $MIX --batch 48 --workers 7 --save-every 100 \
    --stop-after $STOP --export --out $o "$@" >> $R/train_$m.log 2>&1
}
run_both() {
  train demo-llava /root/runs/llava --init assets/demo_towers/demo-llava --minutes 11.5 --lr 7e-4 --warmup 50 "$@" &
  PL=$!
  train demo-internvl /root/runs/internvl --minutes 12.5 --lr 1e-3 --warmup 200 "$@" &
  PI=$!
}
run_both
sleep 200
for pair in "llava $PL demo-llava" "internvl $PI demo-internvl"; do
  set -- $pair
  if ! kill -0 $2 2>/dev/null && ! grep -q "^step 10 " $R/train_$3.log; then
    echo "$3 died early: restarting eager"; tail -5 $R/train_$3.log
    if [ $3 = demo-llava ]; then
      train demo-llava /root/runs/llava --init assets/demo_towers/demo-llava --minutes 11.5 --lr 7e-4 --warmup 50 --compile off &
    else
      train demo-internvl /root/runs/internvl --minutes 12.5 --lr 1e-3 --warmup 200 --compile off &
    fi
  fi
done
wait
for m in demo-llava demo-internvl; do grep -v "^Loading" $R/train_$m.log | grep -v Warn | head -4; grep "^step" $R/train_$m.log | tail -2; grep -v "^step\|Loading" $R/train_$m.log | tail -3; done
