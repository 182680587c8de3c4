package control

import (
	"encoding/binary"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	frmpsv1 "github.com/frmps/frmps/proto/frmps/v1"
)

func sampleEnvelopes() []*frmpsv1.Envelope {
	seed := uint64(7)
	return []*frmpsv1.Envelope{
		{Id: 1, Msg: &frmpsv1.Envelope_Hello{Hello: &frmpsv1.Hello{
			ProtocolVersion: ProtocolVersion, Role: frmpsv1.Role_ROLE_ACTIVE, Pid: 42, Model: "tiny",
			Pools: []*frmpsv1.Pool{{Tag: "weights", Size: 4096, Backend: BackendHostSHM}},
		}}},
		{Id: 2, Msg: &frmpsv1.Envelope_Ping{Ping: &frmpsv1.Ping{}}},
		{Id: 3, Msg: &frmpsv1.Envelope_Resume{Resume: &frmpsv1.Resume{
			RingPath: "/dev/shm/r", SyncEvery: 16,
			Requests: []*frmpsv1.ResumeRequest{{
				Key: 9, Prompt: "héllo", Params: &frmpsv1.SamplingParams{MaxTokens: 8, Seed: &seed},
				DeliveredTokenIds: []uint32{1, 2, 3},
				Snapshot:          &frmpsv1.RequestSnapshot{BlockIds: []uint32{4}, TokenIds: []uint32{5, 6}, NumComputedTokens: 2},
			}},
		}}},
		{Msg: &frmpsv1.Envelope_Fault{Fault: &frmpsv1.Fault{Cause: "misaligned address"}}},
		{Msg: &frmpsv1.Envelope_Shutdown{Shutdown: &frmpsv1.Shutdown{}}},
	}
}

func TestEncodeDecodeRoundTrip(t *testing.T) {
	for _, env := range sampleEnvelopes() {
		frame, err := Encode(env)
		if err != nil {
			t.Fatalf("Encode(%s): %v", MessageName(env), err)
		}
		if got := binary.LittleEndian.Uint32(frame); int(got) != len(frame)-4 {
			t.Fatalf("length prefix %d, body %d bytes", got, len(frame)-4)
		}
		back, err := Decode(frame)
		if err != nil {
			t.Fatalf("Decode(%s): %v", MessageName(env), err)
		}
		if !proto.Equal(env, back) {
			t.Fatalf("round trip changed the message:\n got %v\nwant %v", back, env)
		}
	}
}

func TestEncodeRefuses(t *testing.T) {
	if _, err := Encode(nil); err == nil {
		t.Error("Encode(nil) succeeded")
	}
	if _, err := Encode(&frmpsv1.Envelope{Id: 1}); err == nil {
		t.Error("Encode of an envelope without a message succeeded")
	}
	huge := &frmpsv1.Envelope{Msg: &frmpsv1.Envelope_Fault{Fault: &frmpsv1.Fault{Detail: strings.Repeat("x", MaxFrame)}}}
	if _, err := Encode(huge); !errors.Is(err, ErrFrameTooLarge) {
		t.Errorf("Encode of a %d-byte message: err = %v, want ErrFrameTooLarge", MaxFrame, err)
	}
}

func frameOf(n uint32, body []byte) []byte {
	b := binary.LittleEndian.AppendUint32(nil, n)
	return append(b, body...)
}

func TestDecodeRejects(t *testing.T) {
	good, err := Encode(sampleEnvelopes()[1])
	if err != nil {
		t.Fatal(err)
	}
	noMsg, _ := proto.Marshal(&frmpsv1.Envelope{Id: 5})
	rng := rand.New(rand.NewPCG(1, 2))
	garbage := make([]byte, 64)
	for i := range garbage {
		garbage[i] = byte(rng.UintN(256))
	}
	// 0x0f is field 1 with wire type 7, which does not exist: the bytes
	// cannot parse whatever the random tail is.
	garbage[0] = 0x0f

	cases := []struct {
		name     string
		frame    []byte
		specific error // nil: only ErrProtocol is required
		msg      string
	}{
		{"empty", nil, ErrTruncated, "shorter than"},
		{"short prefix", []byte{1, 0, 0}, ErrTruncated, "shorter than"},
		{"zero length", frameOf(0, nil), ErrEmptyFrame, "length prefix is 0"},
		{"huge length", frameOf(0xffffffff, []byte{1}), ErrFrameTooLarge, "exceeds the maximum"},
		{"just over max", frameOf(MaxFrame+1, nil), ErrFrameTooLarge, "exceeds the maximum"},
		{"truncated", good[:len(good)-1], ErrTruncated, "frame has"},
		{"trailing bytes", append(append([]byte(nil), good...), 0), nil, "trailing"},
		{"garbage body", frameOf(uint32(len(garbage)), garbage), nil, "decode envelope"},
		{"no message", frameOf(uint32(len(noMsg)), noMsg), nil, "no known message"},
		{"unknown field only", frameOf(3, []byte{0xf8, 0x07, 0x01}), nil, "no known message"}, // field 127 varint
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			env, err := Decode(tc.frame)
			if err == nil {
				t.Fatalf("Decode accepted it: %v", env)
			}
			if !errors.Is(err, ErrProtocol) {
				t.Errorf("error %q does not wrap ErrProtocol", err)
			}
			if tc.specific != nil && !errors.Is(err, tc.specific) {
				t.Errorf("error %q does not wrap %v", err, tc.specific)
			}
			if !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("error %q does not say %q", err, tc.msg)
			}
		})
	}
}

// FuzzDecode: Decode never panics, and whatever it accepts re-encodes to a
// frame that decodes to the same message.
func FuzzDecode(f *testing.F) {
	for _, env := range sampleEnvelopes() {
		frame, err := Encode(env)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(frame)
		f.Add(frame[:len(frame)/2])
	}
	f.Add([]byte{})
	f.Add(frameOf(0, nil))
	f.Add(frameOf(0xffffffff, []byte{0xff}))
	f.Add(frameOf(2, []byte{0xa2, 0x01}))
	f.Fuzz(func(t *testing.T, frame []byte) {
		env, err := Decode(frame)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("rejection %q does not wrap ErrProtocol", err)
			}
			return
		}
		again, err := Encode(env)
		if err != nil {
			t.Fatalf("accepted message does not re-encode: %v", err)
		}
		back, err := Decode(again)
		if err != nil {
			t.Fatalf("re-encoded frame does not decode: %v", err)
		}
		if !proto.Equal(env, back) {
			t.Fatalf("re-encoding changed the message")
		}
	})
}
