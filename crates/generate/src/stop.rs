//! When generation ends: an end-of-sequence token, a stop string, or the token budget.

use serde::Serialize;

/// Why generation ended (OpenAI's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// EOS token or stop string.
    Stop,
    /// Token budget reached.
    Length,
}

/// Tracks the text produced and decides when to stop.
#[derive(Debug)]
pub struct StopChecker {
    eos: Vec<u32>,
    stops: Vec<String>,
    max_tokens: usize,
    tokens: usize,
    text: String,
    emitted: usize,
}

impl StopChecker {
    /// Stops at any of `eos`, any of `stops` (not included in the output), or after `max_tokens`.
    pub fn new(eos: &[u32], stops: &[String], max_tokens: usize) -> Self {
        Self {
            eos: eos.to_vec(),
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            max_tokens,
            tokens: 0,
            text: String::new(),
            emitted: 0,
        }
    }

    /// Whether `token` ends generation before it is shown.
    pub fn is_eos(&self, token: u32) -> bool {
        self.eos.contains(&token)
    }

    /// Records a generated token and its text piece. Returns the text that is safe to show
    /// now (held back while it could be the start of a stop string) and whether to stop.
    pub fn push(&mut self, piece: &str) -> (String, Option<FinishReason>) {
        self.tokens += 1;
        self.text.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[self.emitted.min(self.text.len())..]
                    .find(s.as_str())
                    .map(|i| i + self.emitted)
            })
            .min()
        {
            let out = self.text[self.emitted..at].to_string();
            self.text.truncate(at);
            self.emitted = at;
            return (out, Some(FinishReason::Stop));
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let mut safe = self.text.len();
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if self.text.len() >= k
                    && self.text.is_char_boundary(self.text.len() - k)
                    && s.is_char_boundary(k)
                    && self.text.ends_with(&s[..k])
                {
                    safe = safe.min(self.text.len() - k);
                    break;
                }
            }
        }
        let safe = safe.max(self.emitted);
        let out = self.text[self.emitted..safe].to_string();
        self.emitted = safe;
        let done = (self.tokens >= self.max_tokens).then_some(FinishReason::Length);
        if done.is_some() {
            let rest = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            return (out + &rest, done);
        }
        (out, None)
    }

    /// Text still held back (a possible stop-string start), now released because generation
    /// ended another way (an end-of-sequence token).
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        rest
    }

    /// Number of tokens pushed.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The whole text produced (cut at a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_across_pieces_is_cut_and_never_shown() {
        let mut s = StopChecker::new(&[], &["\n\nUser".to_string()], 100);
        let mut shown = String::new();
        let mut reason = None;
        for p in ["Hello", " world", "\n", "\nUs", "er: hi"] {
            let (out, r) = s.push(p);
            shown += &out;
            if r.is_some() {
                reason = r;
                break;
            }
        }
        assert_eq!(shown, "Hello world");
        assert_eq!(s.text(), "Hello world");
        assert_eq!(reason, Some(FinishReason::Stop));
    }

    #[test]
    fn flush_releases_held_text_at_eos() {
        let mut s = StopChecker::new(&[7], &["abc".to_string()], 10);
        assert_eq!(s.push("x a").0, "x ");
        assert_eq!(s.flush(), "a");
        assert_eq!(s.flush(), "");
    }

    #[test]
    fn length_flushes_held_text() {
        let mut s = StopChecker::new(&[], &["abc".to_string()], 2);
        assert_eq!(s.push("x a"), ("x ".to_string(), None));
        assert_eq!(s.push("b"), ("ab".to_string(), Some(FinishReason::Length)));
    }
}
