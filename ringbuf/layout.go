// Package ringbuf is the forward-state ring between the active engine (the
// writer) and the supervisor (the reader). FORMAT.md in this directory is the
// specification; this file is the only place the Go side spells out its
// offsets and constants.
package ringbuf

// File header.
const (
	Magic      = "FRMPSRNG"
	Version    = 1
	HeaderSize = 4096

	MinCapacity = 4096
	MaxCapacity = 1 << 34

	offMagic         = 0
	offVersion       = 8
	offHeaderSize    = 12
	offCapacity      = 16
	offEpoch         = 24
	offFlags         = 32
	offWriteCursor   = 64
	offWriteSeq      = 72
	offResyncRequest = 128
	offResyncAck     = 136
	offReaderCursor  = 192
)

// Record framing.
const (
	RecordAlign      = 32
	RecordHeaderSize = 32

	TypeDelta = 1
	TypeFull  = 2
	TypePad   = 3

	recOffLength     = 0
	recOffType       = 4
	recOffFlags      = 6
	recOffSeq        = 8
	recOffEpoch      = 16
	recOffPayloadLen = 24
	recOffCRC        = 28
	// The CRC covers the header up to (not including) the CRC field, then the payload.
	recCRCHeaderBytes = 28
)

// Payload of DELTA and FULL records.
const (
	payloadFixed = 16 // n u32, reserved u32, step u64
	// Bytes per entry in the fixed-width columns: keys, seeds (u64) and
	// num_computed, num_prompt, flags, n_blocks, n_tokens (u32).
	payloadPerEntry = 8 + 8 + 4*5

	FlagReset    = 1 << 0
	FlagFinished = 1 << 1
	FlagAborted  = 1 << 2
	flagsKnown   = FlagReset | FlagFinished | FlagAborted
)

// alignUp rounds n up to the record alignment.
func alignUp(n uint64) uint64 { return (n + RecordAlign - 1) &^ (RecordAlign - 1) }

// payloadLen is the payload size of a record with the given column sizes.
func payloadLen(n, sumBlocks, sumTokens uint64) uint64 {
	return payloadFixed + payloadPerEntry*n + 4*sumBlocks + 4*sumTokens
}
