//! Envelopes read from an HTTP body as its frames arrive: what envd's request reader and
//! the clients' server-stream reader share.

use std::fmt::Display;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;

use super::{ConnectError, Envelope, EnvelopeDecoder};

/// Why the next envelope could not be read.
pub(crate) enum ReadError {
    /// An envelope the decoder refused (too large, compressed).
    Decode(ConnectError),
    /// The body itself failed (the peer went away mid-stream).
    Body(String),
    /// The body ended inside an envelope.
    Truncated,
}

/// The envelopes of one body.
pub(crate) struct EnvelopeBody<B> {
    pub(crate) body: B,
    decoder: EnvelopeDecoder,
    ended: bool,
}

impl<B> EnvelopeBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Display,
{
    pub(crate) fn new(body: B, max_envelope: usize) -> Self {
        EnvelopeBody {
            body,
            decoder: EnvelopeDecoder::new(max_envelope),
            ended: false,
        }
    }

    /// The next envelope; `Ok(None)` when the body ended between envelopes.
    pub(crate) async fn next(&mut self) -> Result<Option<Envelope>, ReadError> {
        loop {
            if let Some(env) = self.decoder.next_envelope().map_err(ReadError::Decode)? {
                return Ok(Some(env));
            }
            if self.ended {
                return if self.decoder.pending() == 0 {
                    Ok(None)
                } else {
                    Err(ReadError::Truncated)
                };
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.decoder.push(&data);
                    }
                }
                Some(Err(e)) => return Err(ReadError::Body(e.to_string())),
                None => self.ended = true,
            }
        }
    }
}
