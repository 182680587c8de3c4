package ringbuf

func helperMain() int { return 0 }
